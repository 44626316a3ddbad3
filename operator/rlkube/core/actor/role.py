"""The actor role (`python -m rlkube.core.actor`): samples rollout groups from inference and scores them.

Why its own role: sampling and scoring scale apart from training, any number of replicas (RLKUBE_INDEX) sharing the
lag counters in Redis (docs/design.md §7). The steps are named: `build_actor` (task, environment, tokenizer,
rendering, eval set), `Actor.run` (events -> inference health -> workers -> report), `Actor.worker` (reserve ->
`sample_and_write` or `write_reference` -> count, or give the reservation back). What it writes: §5.3; supervised
(sft) groups and their version stamp: §6. The rules it keeps (docs/references.md §6): it stops on
`training_finished`, never by counting samples (§6.1); a group's `model_version` is the weights that sampled it
(§6.9). A stop interrupts every wait, never a Redis write (a reservation is used or given back, never both); a
failed request is retried on the next server, a 400 skips the prompt; a reward that raises scores 0 and is
counted (`reward_errors`), never stopping the actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import redis.asyncio as aioredis

from rlkube.contract import counters, protocol, runtime, streams
from rlkube.core import errors
from rlkube.contract.context import RoleContext
from rlkube.core.hf.loading import load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.actor.lag import LagCounter, documents_seen_of, sample_budget
from rlkube.core.hf.tokenizer import Tokenizer
from rlkube.core.actor.episodes import (Environment, EpisodeResult, Limits, MessageEncoder, Reply, SampleRefused,
                                        call_with_timeout, draw_prompt, run_episode)
from rlkube.core.actor.environments import limits as episode_limits
from rlkube.core.actor.environments import load_environment
from rlkube.core.actor.evaluation import Evaluator, TrainingPrompts, build_eval_set, held_out_fraction
from rlkube.core.actor.tasks import Prompt, Scorer, Task, load_task, prompt_renderer

log = logging.getLogger("rlkube.actor")
T = TypeVar("T")

ENV_STALL_SECONDS = "RLKUBE_ACTOR_STALL_SECONDS"  # optional: holding this long without progress frees credit
DEFAULT_STALL_S = 30.0
REQUEST_TIMEOUT_S = 300.0
MAX_WORKERS_PER_SERVER = 8



@dataclass
class TrainerView:
    """What the actor knows about the trainer, from its events."""

    version: int | None = None  # None until the first weights_ready
    documents_seen: int = 0
    finished: bool = False
    last_event_at: float = 0.0


class InferenceError(RuntimeError):
    pass


class BadPrompt(InferenceError):
    pass


class Stopped(Exception):
    """The actor was asked to stop while it waited (see Actor.until_stopped)."""


def supervised(spec) -> bool:
    """Whether the actor reads reference completions instead of sampling (loss sft with a completionField)."""
    ds = spec.task.dataset
    return spec.algorithm.loss == "sft" and ds is not None and ds.completion_field is not None


class Actor:
    def __init__(self, ctx: RoleContext, client: aioredis.Redis, task: Task,
                 stall_s: float = DEFAULT_STALL_S, render: Callable[[Prompt], str | list[int]] | None = None,
                 tokenizer: Tokenizer | None = None, environment: Environment | None = None,
                 encoder: MessageEncoder | None = None, eval_set: list[Prompt] | None = None):
        self.supervised = supervised(ctx.spec)
        if self.supervised and tokenizer is None:
            raise ValueError("the supervised (sft) actor needs the model's tokenizer")
        if not ctx.inference_urls and not self.supervised:
            raise SystemExit(f"{runtime.ENV_INFERENCE_URLS} is not set: the actor needs the inference servers")
        self.tokenizer = tokenizer
        self.group_n = 1 if self.supervised else ctx.spec.algorithm.group_size  # samples per reservation
        self.ctx = ctx
        self.spec = ctx.spec
        self.algo = ctx.spec.algorithm
        self.redis = client
        self.keys = ctx.keys
        self.task = task
        self.render = render or prompt_renderer(ctx.spec.task, task)  # no tokenizer: plain-text prompts
        self.score = Scorer(task)
        self.scores = callable(getattr(task, "reward", None))  # a supervised dataset may come without a reward
        self.name = f"actor-{ctx.index}"
        self.urls = [u.rstrip("/") for u in ctx.inference_urls]
        self.stall_s = stall_s
        self.inflight = 0  # samples reserved by this replica's workers and not yet written or given back
        self.lag = LagCounter(client, self.keys, self.algo.max_lag, self.algo.samples_per_step)
        self.view = TrainerView()
        self.changed = asyncio.Event()  # set on every weights_ready / training_finished
        self.stop = asyncio.Event()
        # Set by a signal or a failure only, not by training_finished: evaluation (evaluation.py) finishes the
        # versions already due after training_finished, and stops at once on this.
        self.halt = asyncio.Event()
        self.rng = random.Random(ctx.spec.model.seed * 1_000_003 + 7919 * ctx.index + 1)
        self._servers = itertools.cycle(range(len(self.urls)))
        self.groups = 0
        self.samples = 0
        self.reward_sum = 0.0
        self.holds = 0
        self.started = time.monotonic()
        self.failed: BaseException | None = None
        self.seen_at: dict[int, int] = {}  # version -> documents_seen announced with it
        self.resampled = 0
        self.environment = environment
        if environment is not None:
            if tokenizer is None or encoder is None:
                raise ValueError("multi-turn episodes need the model's tokenizer and a message encoder")
            self.encoder = encoder
            self.limits: Limits = episode_limits(ctx.spec.task.environment, ctx.spec.model.max_sequence_length)
        # spec.evaluation: every replica trains on the task without the held-out prompts; the replica given the
        # eval set scores it (rlkube.core.actor.evaluation).
        fraction = held_out_fraction(ctx.spec)
        if fraction is not None:
            self.task = TrainingPrompts(task, fraction)
            if environment is not None and callable(getattr(environment, "prompt", None)):
                self.environment = TrainingPrompts(environment, fraction)
        self.evaluator = Evaluator(self, ctx.spec, eval_set, refused=BadPrompt, stopped=Stopped) if eval_set else None

    # --- stopping ------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.halt.set()
        self.stop.set()
        self.changed.set()  # wakes the workers holding at the lag bound
        self.changed = asyncio.Event()

    async def until_stopped(self, aw: Awaitable[T], stop: asyncio.Event | None = None) -> T:
        """Await `aw` unless the actor is asked to stop first (`stop`, default `self.stop`): then cancel it and
        raise Stopped. Only for waits that may be abandoned (an HTTP request, a pause), never for a Redis write."""
        task = asyncio.ensure_future(aw)
        stopping = asyncio.ensure_future((stop or self.stop).wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            stopping.cancel()
        if task.done():
            return task.result()  # done first (or together with the stop): its outcome counts
        task.cancel()
        await asyncio.wait({task})  # let it clean up (an HTTP request releases its connection)
        raise Stopped

    async def pause(self, seconds: float, stop: asyncio.Event | None = None) -> None:
        """Sleep, but no longer than until the actor is asked to stop (`stop`, default `self.stop`)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((stop or self.stop).wait(), timeout=seconds)

    # --- events --------------------------------------------------------------------------------------

    async def _apply(self, event: protocol.TrainerEvent) -> None:
        if event.type == protocol.TRAINING_FINISHED:
            log.info("training_finished (%s): stopping after %d groups", event.stream_id, self.groups)
            self.view.finished = True
            self.stop.set()  # the workers are woken below
        elif event.type == protocol.WEIGHTS_READY:
            version, seen = documents_seen_of(event.payload, self.algo.samples_per_step)
            lowered = await self.lag.on_weights_ready(event.stream_id, seen)
            if lowered:
                log.warning("trainer went back to %d documents seen (a restart): lag credit lowered by %d",
                            seen, lowered)
            self.view.version, self.view.documents_seen = version, seen
            # Versions above this one belong to a trainer process that died (a restart resumes lower): forget
            # them, or groups would wait for weights that only come after the documents they are meant for.
            for stale in [v for v in self.seen_at if v > version]:
                del self.seen_at[stale]
            self.seen_at[version] = seen
            if self.evaluator is not None:
                self.evaluator.on_version(version)
            if len(self.seen_at) > 4096:
                self.seen_at.pop(min(self.seen_at))
            self.view.last_event_at = time.monotonic()
        else:
            return
        self.changed.set()
        self.changed = asyncio.Event()

    async def follow_events(self) -> None:
        """From the newest weights_ready/training_finished already in the stream on; reconnects on its own."""
        reader = streams.AsyncEventReader(self.redis, self.keys.events, None, stop=self.stop,
                                          latest_of=(protocol.WEIGHTS_READY, protocol.TRAINING_FINISHED))
        async for event in reader.follow(block_ms=1000, count=64):
            await self._apply(event)

    # --- inference -----------------------------------------------------------------------------------

    async def wait_for_inference(self, session: aiohttp.ClientSession) -> None:
        pending = set(self.urls)
        last_log: float | None = None
        while pending and not self.stop.is_set():
            for url in list(pending):
                try:
                    if await self.until_stopped(self._healthy(session, url)):
                        pending.discard(url)
                except (TimeoutError, aiohttp.ClientError):
                    pass
                except Stopped:
                    return
            if pending and (last_log is None or time.monotonic() - last_log > 30):
                log.info("waiting for inference health: %s", ", ".join(sorted(pending)))
                last_log = time.monotonic()
            if pending:
                await self.pause(0.5)

    @staticmethod
    async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status == 200

    async def _complete(self, session: aiohttp.ClientSession, url: str, prompt: str | list[int],
                        min_version: int | None, n: int | None = None, max_tokens: int | None = None,
                        temperature: float | None = None, seed: int | None = None) -> dict:
        body = {
            "model": self.spec.model.path,
            "prompt": prompt,
            "n": self.algo.group_size if n is None else n,
            "max_tokens": self.algo.max_new_tokens if max_tokens is None else max_tokens,
            "temperature": self.algo.temperature if temperature is None else temperature,
            "logprobs": 0,
            "seed": self.rng.getrandbits(62) if seed is None else seed,
        }
        if min_version is not None:
            # An extension of our servers (both engines behind rlkube.core.inference's shell).
            body["min_model_version"] = min_version
        try:
            async with session.post(url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                reply = await resp.json(content_type=None)
                if resp.status == 400:
                    raise BadPrompt(f"{url} rejected the prompt {prompt!r}: {reply}")
                if resp.status != 200:
                    raise InferenceError(f"{url} answered {resp.status}: {reply}")
                return reply
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise InferenceError(f"{url}: {type(exc).__name__}: {exc}") from exc

    def min_version(self, last: int) -> int | None:
        """The oldest announced version whose weights keep sample number `last` within maxLag."""
        ok = [v for v, seen in self.seen_at.items()
              if last <= sample_budget(seen, self.algo.max_lag, self.algo.samples_per_step)]
        return min(ok) if ok else None

    async def request(self, session: aiohttp.ClientSession, prompt: str | list[int], min_version: int | None,
                      n: int | None = None, max_tokens: int | None = None, temperature: float | None = None,
                      seed: int | None = None, stop: asyncio.Event | None = None) -> dict:
        """One completions request, retried on the next server (with back-off) until it succeeds. Raises Stopped
        when the actor stops first (`stop`, default `self.stop`), BadPrompt when a server refuses the prompt.
        `temperature` and `seed` default to the job's sampling (evaluation fixes its own)."""
        stop = stop or self.stop
        delay = 0.2
        while not stop.is_set():
            url = self.urls[next(self._servers)]
            try:
                # A server may hold the request (min_model_version) or never answer (frozen): a stop ends it.
                return await self.until_stopped(self._complete(session, url, prompt, min_version, n, max_tokens,
                                                               temperature, seed), stop)
            except BadPrompt:
                raise  # the prompt itself is refused: no server will take it
            except InferenceError as exc:
                log.warning("inference request failed (%s); retrying in %.1fs", exc, delay)
                await self.pause(delay, stop)
                delay = min(delay * 2, 5.0)
        raise Stopped

    async def sample_group(self, session: aiohttp.ClientSession, min_version: int | None
                           ) -> protocol.RolloutGroup | None:
        """One group, retrying failed requests until it succeeds or the actor stops; None on a bad prompt.
        `min_version`: the oldest weights that may sample it (passed to our native server)."""
        if self.environment is not None:
            return await self.sample_episodes(session, min_version)
        prompt = self.task.prompt(self.rng)
        text = self.render(prompt)
        version_at_start = self.view.version or 0
        try:
            reply = await self.request(session, text, min_version)
        except Stopped:
            return None
        except BadPrompt as exc:
            log.error("%s; skipping it", exc)
            return None
        choices = sorted(reply["choices"], key=lambda c: c["index"])
        samples = []
        for c in choices:
            lp = (c.get("logprobs") or {}).get("token_logprobs") or []
            reward, failed = self.score(prompt, c["text"])
            samples.append(protocol.Sample(completion_tokens=[int(t) for t in c["token_ids"]],
                                           logprobs=[float(x) for x in lp], reward=reward,
                                           finished=c.get("finish_reason") == "stop", reward_error=failed))
        version = reply.get("model_version")
        return protocol.RolloutGroup(
            group_id=f"{self.name}-{uuid.uuid4().hex[:12]}",
            prompt_tokens=[int(t) for t in choices[0]["prompt_token_ids"]],
            samples=samples,
            model_version=int(version) if isinstance(version, int) else version_at_start,
            expected_size=self.algo.group_size,
            actor=self.name,
            created_at=time.time(),
        )

    # --- multi-turn episodes (rlkube.core.actor.episodes) ---------------------------------------------------

    @staticmethod
    def _reply(choice: dict, version: int) -> Reply:
        lp = (choice.get("logprobs") or {}).get("token_logprobs") or []
        ids = [int(t) for t in choice["token_ids"]]
        return Reply(token_ids=ids, logprobs=[float(x) for x in lp], version=version,
                     finished=choice.get("finish_reason") == "stop",
                     prompt_ids=[int(t) for t in choice["prompt_token_ids"]],
                     versions=token_versions(choice.get("model_versions"), len(ids)))

    async def sample_episodes(self, session: aiohttp.ClientSession, min_version: int | None
                              ) -> protocol.RolloutGroup | None:
        """A group of groupSize episodes from one prompt: their first replies in one request, then each episode
        on its own (token ids as prompts, rlkube.core.actor.episodes.run_episode); None when the actor stops, a server
        refuses the first prompt or the environment cannot start an episode."""
        prompt = draw_prompt(self.environment, self.task, self.rng)
        fallback = self.view.version or 0

        def version_of(reply: dict) -> int:
            v = reply.get("model_version")
            return int(v) if isinstance(v, int) else fallback

        async def sample(ids: list[int], max_tokens: int) -> Reply:
            try:
                reply = await self.request(session, ids, min_version, n=1, max_tokens=max_tokens)
            except BadPrompt as exc:
                raise SampleRefused(str(exc)) from None
            return self._reply(reply["choices"][0], version_of(reply))

        try:
            episodes = [await call_with_timeout(self.environment.start, prompt, timeout=self.limits.tool_timeout_s)
                        for _ in range(self.algo.group_size)]
        except Exception as exc:  # noqa: BLE001 - the environment's code (ToolTimeout included)
            log.error("the environment could not start an episode from %r: %s: %s; skipping it", prompt.text[:200],
                      type(exc).__name__, exc)
            return None
        rendered = self.render(prompt)
        max_tokens = self.algo.max_new_tokens
        if self.limits.max_episode_tokens is not None:
            length = len(rendered) if isinstance(rendered, list) else len(self.tokenizer.encode(rendered))
            max_tokens = min(max_tokens, self.limits.max_episode_tokens - length)
            if max_tokens < 1:
                log.error("prompt %r is %d tokens: no room for a reply within the episode budget of %d tokens; "
                          "skipping it", prompt.text[:200], length, self.limits.max_episode_tokens)
                return None
        try:
            first = await self.request(session, rendered, min_version, max_tokens=max_tokens)
            version = version_of(first)
            choices = sorted(first["choices"], key=lambda c: c["index"])
            runs = [asyncio.ensure_future(run_episode(ep, self._reply(c, version), sample, self.encoder,
                                                      self.tokenizer.decode, self.limits, self.algo.max_new_tokens))
                    for ep, c in zip(episodes, choices, strict=True)]
            try:
                results = await asyncio.gather(*runs)
            except BaseException:
                for run in runs:  # one stopped: the group is abandoned, its other episodes too
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                raise
        except Stopped:
            return None
        except BadPrompt as exc:
            log.error("%s; skipping it", exc)
            return None
        for r in results:
            r.drifted = self._drifted(prompt, r)
        return self.episode_group(results)

    def _drifted(self, prompt: Prompt, result: EpisodeResult) -> bool:
        """Whether rendering the episode's conversation whole gives other ids than the exact ones (counted)."""
        try:
            return self.encoder.drifted(prompt, result)
        except Exception as exc:  # noqa: BLE001 - a template that cannot render the whole conversation
            log.warning("the conversation cannot be re-rendered to check drift (%s: %s); counted as drifted",
                        type(exc).__name__, exc)
            return True

    def episode_group(self, results: list[EpisodeResult]) -> protocol.RolloutGroup:
        samples = [protocol.Sample(
            completion_tokens=r.tokens, logprobs=r.logprobs, reward=r.reward, finished=r.finished and not r.truncated,
            reward_error=r.reward_error, env_spans=r.env_spans, versions=r.versions, episode=r.counts())
            for r in results]
        return protocol.RolloutGroup(
            group_id=f"{self.name}-{uuid.uuid4().hex[:12]}",
            prompt_tokens=results[0].prompt_ids,
            samples=samples,
            # The oldest weights any token was sampled with: the lag bound holds for every token of the group.
            model_version=min(min(r.versions) for r in results),
            expected_size=self.algo.group_size,
            actor=self.name,
            created_at=time.time(),
        )

    def episode_totals(self, group: protocol.RolloutGroup) -> dict[str, int | float] | None:
        """A group's episode counts, added to the job's totals (the trainer reports them) by the script that writes
        the group (rlkube.core.actor.lag): None without an environment. Each is summed as its counter's type
        (rlkube.contract.counters), so a group without per-turn rewards still adds the float 0.0 to their sum."""
        if self.environment is None:
            return None
        return counters.group_totals([s.episode or {} for s in group.samples])

    # --- supervised (sft): reference completions from the dataset ------------------------------------

    def reference_group(self, prompt: Prompt) -> protocol.RolloutGroup:
        """One row as a one-sample group: the prompt's ids as inference would get them, the reference
        completion's ids plus eos, sampling log-probs 0, stamped with version 0 until it is written."""
        tok = self.tokenizer
        rendered = self.render(prompt)
        prompt_ids = list(rendered) if isinstance(rendered, list) else tok.encode(rendered)
        completion = prompt.meta["completion"]
        ids = list(tok.hf(completion, add_special_tokens=False)["input_ids"])
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
        reward, failed = self.score(prompt, completion) if self.scores else (0.0, False)
        sample = protocol.Sample(completion_tokens=ids, logprobs=[0.0] * len(ids), reward=reward, finished=True,
                                 reward_error=failed)
        return protocol.RolloutGroup(group_id=f"{self.name}-{uuid.uuid4().hex[:12]}", prompt_tokens=prompt_ids,
                                     samples=[sample], model_version=0, expected_size=1, actor=self.name,
                                     created_at=time.time())

    async def write_reference(self) -> bool:
        """Read the next row and write it (module docstring: the version it is stamped with); False when the
        actor stopped first."""
        group = self.reference_group(self.task.prompt(self.rng))
        while not self.stop.is_set():
            changed = self.changed
            group.model_version = self.view.version or 0
            if await self.lag.write(group, self.view.documents_seen) is not None:
                self._count(group)
                return True
            self.resampled += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)
        return False

    # --- workers -------------------------------------------------------------------------------------

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

    def _events_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Without events the actor can neither follow the lag bound nor stop: fail loudly (a restart helps).
            log.error("following the events stream failed: %r", task.exception())
            self.failed = task.exception()
            self.request_stop()

    async def run(self) -> int:
        """The role's steps: follow the trainer's events -> wait for inference -> the workers (and evaluation)
        until the stop -> report."""
        events = asyncio.create_task(self.follow_events(), name="events")
        events.add_done_callback(self._events_done)
        try:
            async with aiohttp.ClientSession() as session:
                if not self.supervised:  # sft reads the dataset: it never asks inference
                    await self.wait_for_inference(session)
                if self.stop.is_set():
                    return 0
                await self._run_workers(session)
        finally:
            events.cancel()
            await asyncio.gather(events, return_exceptions=True)
        if self.failed is not None:
            raise self.failed
        self._report()
        return 0

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

    def _report(self) -> None:
        log.info("%s stopped: %d groups, %d samples, mean reward %.3f, %d reward errors in %d completions scored, "
                 "held %d times, %d groups sampled again (too old for their stream position)", self.name, self.groups,
                 self.samples, self.reward_sum / max(self.samples, 1), self.score.errors, self.score.scored,
                 self.holds, self.resampled)


def token_versions(spans: object, n: int) -> list[int] | None:
    """Our engines' per-choice `model_versions` ([[first token index, version], ...], rlkube.core.openai_api) as one
    version per token; None when absent or malformed (the reply's one `model_version` then stands for all)."""
    if not isinstance(spans, list) or not spans:
        return None
    try:
        starts = [(int(first), int(version)) for first, version in spans]
    except (TypeError, ValueError):
        return None
    if starts[0][0] != 0:
        return None
    out = []
    for k, (first, version) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else n
        out += [version] * max(0, end - first)
    return out if len(out) == n else None


def build_actor(ctx: RoleContext, client: aioredis.Redis) -> Actor:
    """The actor of this replica from its spec: the environment or task, the tokenizer and prompt rendering it
    needs, and (actor 0 with spec.evaluation) the eval set."""
    environment = load_environment(ctx.spec.task)
    # An environment that draws its own prompts is the task as far as prompts go (rendering, raw text or chat).
    own_prompts = environment is not None and callable(getattr(environment, "prompt", None))
    task = environment if own_prompts else load_task(ctx.spec.task, shard=(ctx.index, ctx.spec.actor.replicas))
    # The prompts are rendered here, not by inference, with the model's tokenizer (its chat template) unless the
    # task's prompts are raw text (the digit tasks): those go as text, tokenized by inference as vLLM does.
    chat = ctx.spec.task.chat_template
    tokenizer = None
    if (chat or (chat is None and not getattr(task, "raw_prompts", False)) or supervised(ctx.spec)
            or environment is not None):  # episodes decode replies and encode the environment's turns
        tokenizer = load_tokenizer(materialize_model(ctx.spec.model, ctx.model_cache_dir))
    render = prompt_renderer(ctx.spec.task, task, tokenizer=tokenizer.hf if tokenizer else None)
    encoder = None
    if environment is not None:
        encoder = MessageEncoder(tokenizer.hf, chat_template=bool(getattr(render, "chat_template", False)))
    if getattr(render, "chat_template", False):
        # A rendered conversation holds the special tokens its template writes (a Llama template's BOS): send its
        # ids, tokenized without adding them again (a text prompt would get a second BOS from inference).
        as_text = render

        def render(prompt: Prompt) -> list[int]:
            return tokenizer.hf(as_text(prompt), add_special_tokens=False)["input_ids"]
    stall_s = float(os.environ.get(ENV_STALL_SECONDS) or DEFAULT_STALL_S)
    # Actor 0 scores the eval set (spec.evaluation); a split that overlaps training stops it here, naming the field.
    eval_set = build_eval_set(ctx.spec, environment) if ctx.spec.evaluation is not None and ctx.index == 0 else None
    return Actor(ctx, client, task, stall_s=stall_s, render=render, tokenizer=tokenizer, environment=environment,
                 encoder=encoder, eval_set=eval_set)


async def amain() -> int:
    ctx = RoleContext.from_env()
    client = aioredis.Redis.from_url(ctx.redis_url, socket_timeout=30)
    actor = build_actor(ctx, client)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("signal %d: stopping", s), actor.request_stop()))
    try:
        return await actor.run()
    finally:
        await client.aclose()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(levelname)s %(message)s")
    # A task that cannot work (a missing dataset or column, ...) is a TaskError, a ConfigError: exit EXIT_CONFIG
    # with its message, which names the spec field, as the termination message.
    return errors.run_role(lambda: asyncio.run(amain()))
