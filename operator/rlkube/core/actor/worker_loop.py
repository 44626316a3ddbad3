"""The actor's worker loop: each worker reserves a group within the lag bound (rlkube.core.actor.lag), samples or
reads it (rlkube.core.actor.sampling_modes) and writes it, or gives the reservation back; a group too old for the
stream position it would get is sampled again with newer weights (docs/design.md §7). A stop interrupts every wait,
never a Redis write: a reservation is used or given back, never both.

A mixin of rlkube.core.actor.role.Actor, which owns the state it uses and starts the loop (`Actor.run`).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from rlkube.contract import protocol
from rlkube.core.actor.lag import sample_budget

log = logging.getLogger("rlkube.actor")

MAX_WORKERS_PER_SERVER = 8


class WorkerLoop:
    """Reserve -> sample or read -> write, on as many workers as the servers keep busy (mixed into
    rlkube.core.actor.role.Actor)."""

    def min_version(self, last: int) -> int | None:
        """The oldest announced version whose weights keep sample number `last` within maxLag."""
        ok = [v for v, seen in self.seen_at.items()
              if last <= sample_budget(seen, self.algo.max_lag, self.algo.samples_per_step)]
        return min(ok) if ok else None

    async def reserve(self) -> int | None:
        """Wait until a group fits within the lag bound and reserve it: the number of its last sample, or None
        when the actor stops."""
        n = self.group_n
        held_since: float | None = None
        waiting_logged = False
        while not self.stop.is_set():
            changed = self.changed
            if self.view.version is None:
                if not waiting_logged:
                    log.info("waiting for the trainer's first weights_ready")
                    waiting_logged = True
            elif (last := await self.lag.reserve(n, self.view.documents_seen)) is not None:
                return last
            elif held_since is None:
                held_since = time.monotonic()
                self.holds += 1
                log.info("holding: another group would exceed maxLag=%d (trainer version %d, %d documents seen)",
                         self.algo.max_lag, self.view.version, self.view.documents_seen)
            else:
                waited = time.monotonic() - max(held_since, self.view.last_event_at)
                if (waited >= self.stall_s and await self.lag.trainer_starving()
                        and (what := await self.lag.release_if_stalled(n, self.stall_s, self.inflight))):
                    log.warning("no trainer progress for %.0fs while holding and the trainer lacks documents: "
                                "released %s (samples that never reached the trainer, seed 6.8)", waited, what)
            try:
                await asyncio.wait_for(changed.wait(), timeout=min(1.0, self.stall_s))
            except TimeoutError:
                pass
        return None

    async def worker(self, session: aiohttp.ClientSession) -> None:
        while not self.stop.is_set():
            last = await self.reserve()
            if last is None:
                return
            produced = False
            self.inflight += self.group_n
            try:
                if self.supervised:
                    produced = await self.write_reference()
                elif (group := await self.sample_and_write(session, last)) is not None:
                    produced = True
                    self._count(group)
            finally:
                self.inflight -= self.group_n
                if not produced:
                    # Cancelled, stopped or skipped: the reservation was not used (best effort on shutdown).
                    try:
                        await asyncio.shield(self.lag.give_back(self.group_n))
                    except Exception as exc:  # noqa: BLE001 - Redis may be gone already at shutdown
                        log.debug("could not give back a reservation: %s", exc)

    async def sample_and_write(self, session: aiohttp.ClientSession, last: int) -> protocol.RolloutGroup | None:
        """Sample a group for the reservation ending at sample `last` and write it: the group written, or None (the
        actor stopped, or the prompt was refused)."""
        group = await self.sample_group(session, self.min_version(last))
        retry = 0
        while group is not None and not self.stop.is_set():
            seen = self.documents_seen_for(group.model_version)
            if seen is not None and await self.lag.write(group, seen, self.episode_totals(group)) is not None:
                return group
            # Too old for the position it would get: the server still had older weights than announced
            # (the transfer follows the announcement), restarted without them, or a group reserved after
            # this one was written first. Sample again with the newest weights.
            self.resampled += 1
            retry += 1
            await self.pause(min(0.01 * 2**retry, 1.0))
            group = await self.sample_group(session, self.view.version)
        return None

    def documents_seen_for(self, version: int) -> int | None:
        """documents_seen announced with `version`; None when it is older than anything we remember."""
        seen = self.seen_at.get(version)
        if seen is None and self.seen_at and version > max(self.seen_at):
            return self.view.documents_seen  # newer than our event reader got to: at least the newest budget
        return seen

    def _count(self, group: protocol.RolloutGroup) -> None:
        self.groups += 1
        self.samples += len(group.samples)
        self.reward_sum += sum(s.reward for s in group.samples)
        if self.groups % 20 == 0:
            rate = self.samples / max(time.monotonic() - self.started, 1e-9)
            log.info("%d groups, %.1f samples/s, mean reward %.3f, %d reward errors, version %s", self.groups, rate,
                     self.reward_sum / max(self.samples, 1), self.score.errors, self.view.version)

    def worker_count(self) -> int:
        if self.supervised:
            return 1  # reading a row takes microseconds: one worker keeps up with any trainer
        per_server = max(1, min(MAX_WORKERS_PER_SERVER, self.algo.samples_per_step // self.algo.group_size))
        return per_server * len(self.urls)

    async def _run_workers(self, session: aiohttp.ClientSession) -> None:
        """The workers, and actor 0's evaluation, until the actor stops or one fails (its error is raised)."""
        n = self.worker_count()
        log.info("%s: %d workers over %d inference servers (group %d, maxLag %d, %d samples/step)",
                 self.name, n, len(self.urls), self.algo.group_size, self.algo.max_lag,
                 self.algo.samples_per_step)
        workers = [asyncio.create_task(self.worker(session), name=f"worker-{i}") for i in range(n)]
        if self.evaluator is not None:
            workers.append(asyncio.create_task(self.evaluator.run(session), name="evaluation"))
        stop_wait = asyncio.create_task(self.stop.wait())
        await asyncio.wait([*workers, stop_wait], return_when=asyncio.FIRST_EXCEPTION)
        for w in workers:
            w.cancel()
        results = await asyncio.gather(*workers, return_exceptions=True)
        stop_wait.cancel()
        errors = [r for r in results if isinstance(r, BaseException)
                  and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise errors[0]
