"""Where an inference engine's weight updates come from, chosen once when the engine opens: our own versioned group
(rlkube.core.weights.group, docs/design.md §5.6) or Fast-LLM's broadcast (rlkube.core.weights.fast_llm, §8).

The two differ in when the engine joins and what the events stream means to it, not in what an update is once it
arrives: ours is joined on an announced epoch that is new (a restarted trainer opens another), Fast-LLM's at
start-up, again after a failed transfer, and when the trainer pod's launcher announces a new broadcast store
(`broadcast_opened`). The shell's weight follower (rlkube.core.inference.shell) asks the engine's source at each of
those moments; the engine joins the group (`Engine.join`, `Engine.join_broadcast`) and receives the announced
update streamed into its model the same way for both (`Engine.receive_announced`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from rlkube.api.role import Backend
from rlkube.contract import protocol
from rlkube.core.weights.group import StaleEpoch, WeightSyncError

log = logging.getLogger("rlkube.inference")

"""`spec.trainer.backend` whose trainer broadcasts Fast-LLM's way."""


class Engine(Protocol):
    """What a source asks of the engine it feeds (rlkube.core.inference.engine.Engine has it all)."""

    epoch: str | None
    fast_llm_generation: str | None
    world_size: int

    @property
    def joined(self) -> bool: ...

    def ranks_text(self) -> str: ...

    def join(self, epoch: str) -> None: ...

    def join_broadcast(self, stop: threading.Event) -> bool: ...

    def leave(self) -> None: ...


class WeightSource:
    """Our versioned group (the default): joined when an announcement names an epoch other than the one held. A
    TransportMismatch at join is raised to the caller (a configuration error no rejoin mends)."""

    name = "weight-update group"

    def start(self, engine: Engine, stop: threading.Event) -> bool:
        """Join what must be joined before any announcement; False when `stop` was set first."""
        return True

    def prepare(self, engine: Engine, event: protocol.TrainerEvent, stop: threading.Event) -> bool:
        """Be in the group that sends `event`'s update (a `weights_ready`); False: skip this announcement."""
        epoch = event.payload.get("epoch")
        if not isinstance(epoch, str):
            log.warning("weights_ready %s has no `epoch`: not a native weight-sync trainer; ignored",
                        event.stream_id)
            return False
        if epoch == engine.epoch:
            return True
        log.info("joining weight-update epoch %s (was %s)", epoch, engine.epoch)
        try:
            engine.join(epoch)
        except StaleEpoch as exc:
            log.info("%s", exc)
            return False
        except WeightSyncError as exc:
            log.warning("joining epoch %s failed: %s; waiting for the next announcement", epoch, exc)
            return False
        return True

    def opened(self, engine: Engine, event: protocol.TrainerEvent,
               newest: Callable[[], protocol.TrainerEvent | None], stop: threading.Event) -> None:
        """A `broadcast_opened` announcement (`newest` reads the newest one in the stream): nothing to ours."""

    def transfer_failed(self, engine: Engine, stop: threading.Event) -> None:
        """A transfer failed (the engine left the group): ours is rejoined on the trainer's next epoch."""


class FastLlmBroadcast(WeightSource):
    """Fast-LLM's broadcast group: formed once by its trainer, before its first `weights_ready` (which carries no
    epoch: the step is the version), so it is joined at start-up, after a failed transfer (Fast-LLM forms it anew)
    and on the newest announcement of another broadcast store's generation (a restarted trainer, which waits in
    its group constructor for every receiver: rlkube.contract.fast_llm_rendezvous.GENERATION_KEY)."""

    name = "Fast-LLM's weight broadcast"

    def _join(self, engine: Engine, stop: threading.Event) -> bool:
        """Join, retrying until the group forms or `stop` is set."""
        while not stop.is_set():
            try:
                if not engine.join_broadcast(stop):
                    return False
                log.info("joined Fast-LLM's weight broadcast as %s of %d", engine.ranks_text(), engine.world_size)
                return True
            except WeightSyncError as exc:
                log.warning("joining Fast-LLM's weight broadcast: %s; retrying", exc)
                stop.wait(1.0)
        return False

    def start(self, engine: Engine, stop: threading.Event) -> bool:
        return self._join(engine, stop)

    def prepare(self, engine: Engine, event: protocol.TrainerEvent, stop: threading.Event) -> bool:
        # Fast-LLM announces, then broadcasts (streaming.py:99-116).
        return engine.joined or self._join(engine, stop)

    def opened(self, engine: Engine, event: protocol.TrainerEvent,
               newest: Callable[[], protocol.TrainerEvent | None], stop: threading.Event) -> None:
        """Unless it is the generation of the group held, leave that group (its trainer is gone) and join the new
        one. Only the newest announcement counts: every generation is reached at the same address, so acting on
        an older one would leave the current group."""
        latest = newest()
        if latest is not None and latest.stream_id != event.stream_id:
            return  # a newer announcement follows in the stream
        generation = event.payload.get("generation")
        if engine.joined and engine.fast_llm_generation == generation:
            return
        log.info("Fast-LLM's trainer opened broadcast generation %s (%s): joining it", generation,
                 f"ours is {engine.fast_llm_generation}" if engine.joined else "no group held")
        engine.leave()
        self._join(engine, stop)

    def transfer_failed(self, engine: Engine, stop: threading.Event) -> None:
        self._join(engine, stop)  # the transfer failed and the group was left: Fast-LLM forms it anew


def weight_source(spec) -> WeightSource:
    """The source `spec` (a TrainingJobSpec) implies: Fast-LLM's broadcast for a Fast-LLM trainer, else ours."""
    return FastLlmBroadcast() if spec.trainer.backend == Backend.FAST_LLM else WeightSource()
