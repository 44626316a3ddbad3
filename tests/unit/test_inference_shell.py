"""The inference shell's weight follower (rlkube.core.inference.shell.WeightFollower) over the engine interface
(rlkube.core.inference.engine): the order of an update and what a failed one leaves, for any engine. The engines
themselves are exercised for real by tests/integration/inference/test_inference.py (native) and test_vllm_server.py
(vLLM); here an engine that records what it is asked drives the shell's decisions."""

from __future__ import annotations

import threading

import pytest
from rlkube.contract import protocol
from rlkube.core.inference.engine import PARAMETERS, Engine, Received, UpdateRefused
from rlkube.contract.weight_transport import TransportMismatch
from rlkube.core.inference import shell
from rlkube.core.inference.shell import WeightFollower
from rlkube.core.inference.weight_source import FastLlmBroadcast, WeightSource
from rlkube.core.weights.group import StaleEpoch, WeightSyncError

pytestmark = pytest.mark.unit


class RecordingEngine(Engine):
    """Joins, receives and applies as told (`outcomes`: what each receive does), recording every call."""

    name = "recording"

    def __init__(self, fast_llm: bool = False, outcomes: list | None = None, join_error: Exception | None = None):
        self.source = FastLlmBroadcast() if fast_llm else WeightSource()  # as each engine's open chooses it
        self.epoch = None
        self.ranks = [1]
        self.world_size = 2
        self.served = None
        self.calls: list[tuple] = []
        self.outcomes = list(outcomes or [])
        self.join_error = join_error
        self.store_generation: str | None = None  # what the broadcast store names at the next Fast-LLM join
        self._version = 0
        self._joined = False

    @property
    def version(self) -> int:
        return self._version

    @property
    def joined(self) -> bool:
        return self._joined

    def join_broadcast(self, stop: threading.Event) -> bool:
        self.calls.append(("join_broadcast",))
        self._joined, self.epoch, self.fast_llm_generation = True, "fast-llm", self.store_generation
        return True

    def join(self, epoch: str) -> None:
        self.calls.append(("join", epoch))
        if self.join_error is not None:
            raise self.join_error
        self._joined, self.epoch = True, epoch

    def receive_announced(self, step: int) -> Received:
        self.calls.append(("receive", step))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            self._joined = False  # as both engines: a failed transfer leaves the group
            raise outcome
        return Received(version=outcome, adapter=False, checksum=float(outcome), checksum_source=PARAMETERS,
                        transfer_s=0.0, load_s=0.0)

    def apply(self, update: Received) -> None:
        self.calls.append(("apply", update.version))
        self._version = update.version

    def leave(self) -> None:
        self.calls.append(("leave",))
        self._joined = False

    def start(self) -> None: ...

    async def generate(self, req):
        raise NotImplementedError

    def stream(self, req, chunks):
        raise NotImplementedError

    def shutdown(self) -> None: ...

    async def close(self) -> str | None:
        return None


def ready(epoch: str | None, step: int) -> protocol.TrainerEvent:
    payload = {"type": protocol.WEIGHTS_READY, "step": step, "version": step}
    if epoch is not None:
        payload["epoch"] = epoch
    return protocol.TrainerEvent(f"{step}-0", protocol.WEIGHTS_READY, payload)


def test_an_update_joins_a_new_epoch_once_and_is_in_effect_with_its_checksum():
    engine = RecordingEngine(outcomes=[0, 1])
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(ready("e1", 0))
    follower.handle(ready("e1", 1))
    assert engine.calls == [("join", "e1"), ("receive", 0), ("apply", 0), ("receive", 1), ("apply", 1)]
    assert follower.synced.is_set() and follower.updates == 2 and engine.version == 1
    assert (follower.served_checksum, follower.checksum_source) == (1.0, PARAMETERS)


def test_a_stale_or_unreachable_epoch_receives_nothing_and_counts_no_refusal():
    for error in (StaleEpoch("formed without this server"), WeightSyncError("store unreachable")):
        engine = RecordingEngine(join_error=error)
        follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
        follower.handle(ready("e1", 0))
        assert engine.calls == [("join", "e1")]
        assert not follower.synced.is_set() and follower.rejected == 0


def test_a_transport_mismatch_at_join_stops_the_server_naming_both(monkeypatch):
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(shell.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    error = TransportMismatch("the trainer sends over 'nccl', the receiver joins over 'gloo'")
    engine = RecordingEngine(join_error=error)
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(ready("e1", 0))
    assert engine.calls == [("join", "e1")] and not follower.synced.is_set()
    assert follower.fatal == str(error) and killed == [(shell.os.getpid(), shell.signal.SIGTERM)]


def test_a_refused_update_keeps_the_served_version_and_is_counted_with_its_reason():
    engine = RecordingEngine(outcomes=[0, UpdateRefused("checksum mismatch"), WeightSyncError("broadcast failed")])
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(ready("e1", 0))
    follower.handle(ready("e1", 1))
    follower.handle(ready("e1", 2))
    assert engine.version == 0 and follower.updates == 1 and follower.served_checksum == 0.0
    assert follower.rejected == 2 and follower.last_error == "broadcast failed" and follower.fatal is None
    assert ("apply", 1) not in engine.calls and ("apply", 2) not in engine.calls


def test_an_announcement_without_epoch_from_our_wire_is_ignored():
    engine = RecordingEngine(outcomes=[0])
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(ready(None, 0))
    assert engine.calls == [] and not follower.synced.is_set()


def test_fast_llm_updates_are_versioned_by_the_step_and_a_failed_transfer_rejoins_the_group():
    engine = RecordingEngine(fast_llm=True, outcomes=[WeightSyncError("Fast-LLM weight broadcast failed"), 4])
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(ready(None, 3))  # not joined yet: joins first
    assert engine.calls == [("join_broadcast",), ("receive", 3), ("join_broadcast",)]
    follower.handle(ready(None, 4))
    assert engine.calls[3:] == [("receive", 4), ("apply", 4)]
    assert follower.rejected == 1 and engine.version == 4


def _announce(client, keys: protocol.StreamKeys, generation: str) -> protocol.TrainerEvent:
    """What the trainer pod's launcher writes before Fast-LLM starts (rlkube.core.launch.fast_llm)."""
    sid = client.xadd(keys.events, protocol.encode_event(protocol.BROADCAST_OPENED, generation=generation))
    ((_, fields),) = client.xrange(keys.events, sid, sid)
    return protocol.decode_event(sid, fields)


def test_a_restarted_fast_llm_trainer_is_rejoined_on_its_announcement_and_only_the_newest_counts(redis_client):
    keys = protocol.StreamKeys("t/")
    engine = RecordingEngine(fast_llm=True)
    follower = WeightFollower(redis_client, keys, engine)
    engine.store_generation = "g1"
    first = _announce(redis_client, keys, "g1")
    follower.handle(first)  # no group held: join the announced one
    assert engine.calls == [("leave",), ("join_broadcast",)] and engine.fast_llm_generation == "g1"
    follower.handle(first)  # the generation held: nothing to do
    assert len(engine.calls) == 2
    # The trainer restarted twice: only the newest announcement is acted on (both stores are at one address).
    second, third = _announce(redis_client, keys, "g2"), _announce(redis_client, keys, "g3")
    engine.store_generation = "g3"
    follower.handle(second)
    assert len(engine.calls) == 2
    follower.handle(third)
    assert engine.calls[2:] == [("leave",), ("join_broadcast",)] and engine.fast_llm_generation == "g3"
    # A receiver that already joined the newest store (after a failed transfer) stays in it.
    follower.handle(third)
    assert len(engine.calls) == 4


def test_a_broadcast_announcement_means_nothing_to_our_own_wire(redis_client):
    keys = protocol.StreamKeys("t/")
    engine = RecordingEngine()
    WeightFollower(redis_client, keys, engine).handle(_announce(redis_client, keys, "g1"))
    assert engine.calls == []


def test_training_finished_leaves_the_group_and_a_stopped_follower_takes_no_update():
    engine = RecordingEngine(outcomes=[0])
    follower = WeightFollower(None, protocol.StreamKeys("t/"), engine)
    follower.handle(protocol.TrainerEvent("9-0", protocol.TRAINING_FINISHED, {"type": protocol.TRAINING_FINISHED}))
    assert engine.calls == [("leave",)] and follower.finished.is_set()
    follower.request_stop()
    follower.handle(ready("e1", 0))
    assert engine.calls == [("leave",)]


def test_the_join_is_logged_as_each_engine_logged_it_before_the_shell():
    # tests/e2e/node_agent/test_fast_llm_job.py reads these lines: one rank for the native engine's one process, the
    # list of the workers' ranks for vLLM (the interface's default).
    from types import SimpleNamespace

    from rlkube.core.inference.native_engine import NativeEngine

    assert NativeEngine.ranks_text(SimpleNamespace(ranks=[1])) == "rank 1"
    assert RecordingEngine().ranks_text() == "ranks [1]"
