"""The trainer role stops within its grace period even when it cannot make progress: SIGTERM while a weight
transfer is blocked (no inference server joins, or one died), and giving up when no document arrives."""

from __future__ import annotations

import signal
import time

import pytest
from support.core_roles import (
    Role,
    add_documents,
    free_port,
    keys_for,
    make_documents,
    read_events,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_trainer,
    tiny_spec,
    wait_for,
)
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol, runtime
from rlkube.core.trainer import ENV_DOCUMENT_TIMEOUT, document_timeout_from_env
from rlkube.core.weights.group import WeightReceiver

START_TIMEOUT = 60
GRACE = 10  # well inside the trainer's default teardown grace period (30 s); gloo's own timeout is 300 s


def _assert_stops_interrupted(role: Role, client, keys, step: int) -> float:
    t0 = time.monotonic()
    role.proc.send_signal(signal.SIGTERM)
    assert role.wait(GRACE) == 0, role.log()
    took = time.monotonic() - t0
    finished = read_events(client, keys, protocol.TRAINING_FINISHED)
    assert len(finished) == 1, role.log()
    assert finished[0].payload["interrupted"] is True and finished[0].payload["step"] == step
    assert ckpt.read_meta(ckpt.Path(finished[0].payload["checkpoint"])).step == step
    assert "abandoning the weight transfer" in role.log()
    return took


def test_sigterm_while_no_inference_server_ever_joins(redis_client, redis_server, tmp_path, roles):
    """The start-up transfer waits for every inference rank to join the group (up to gloo's 300 s)."""
    spec = tiny_spec(maxSteps=5, samplesPerStep=4)
    keys = keys_for("nojoin", spec)
    trainer = start_trainer(roles, tmp_path, "nojoin", spec, redis_server.url,
                            **{runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{free_port()}"})
    # weights_ready is announced before the transfer starts: from then on the trainer is blocked in it
    wait_for(lambda: read_events(redis_client, keys, protocol.WEIGHTS_READY), START_TIMEOUT, "weights_ready", trainer)
    took = _assert_stops_interrupted(trainer, redis_client, keys, step=0)
    print(f"stopped {took:.2f}s after SIGTERM while blocked in the start-up transfer")


def test_sigterm_while_the_transfer_waits_for_a_dead_inference_server(redis_client, redis_server, tmp_path, roles):
    """An inference server joins, receives version 0 and dies: the next publish reopens a group that nobody joins."""
    spec = tiny_spec(maxSteps=5, samplesPerStep=4)
    keys = keys_for("dead", spec)
    addr = f"127.0.0.1:{free_port()}"
    trainer = start_trainer(roles, tmp_path, "dead", spec, redis_server.url, **{runtime.ENV_WEIGHT_SYNC: addr})
    ready = wait_for(lambda: read_events(redis_client, keys, protocol.WEIGHTS_READY), START_TIMEOUT,
                     "weights_ready", trainer)
    rx = WeightReceiver(addr, rank=1, world_size=2, timeout_s=20, local_host="127.0.0.1")
    try:
        rx.join(ready[0].payload["epoch"])
        version, _ = rx.receive()
        assert version == 0
    finally:
        rx.close()  # the inference server is gone
    add_documents(redis_client, keys, make_documents(4))
    wait_for(lambda: [e for e in read_events(redis_client, keys, protocol.WEIGHTS_READY)
                      if e.payload["version"] == 1], START_TIMEOUT, "the announcement of version 1", trainer)
    took = _assert_stops_interrupted(trainer, redis_client, keys, step=1)
    print(f"stopped {took:.2f}s after SIGTERM while blocked in the transfer of version 1")


def test_no_document_for_the_timeout_exits_nonzero_without_finished(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=5, samplesPerStep=4)
    keys = keys_for("starved", spec)
    trainer = start_trainer(roles, tmp_path, "starved", spec, redis_server.url, **{ENV_DOCUMENT_TIMEOUT: "3"})
    add_documents(redis_client, keys, make_documents(4))  # one step, then nothing
    assert trainer.wait(START_TIMEOUT) == 1, trainer.log()
    assert "no training document for 3s" in trainer.log()
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [1]
    # the step it did train is not lost: a restarted trainer resumes from it
    saved = read_events(redis_client, keys, protocol.CHECKPOINT_SAVED)
    assert [e.step for e in saved] == [1] and ckpt.read_meta(ckpt.Path(saved[0].payload["path"])).step == 1


def test_document_timeout_setting():
    assert document_timeout_from_env({}) == 600.0  # Fast-LLM's default
    assert document_timeout_from_env({ENV_DOCUMENT_TIMEOUT: "2.5"}) == 2.5
    for bad in ("soon", "0", "-1"):
        with pytest.raises(ValueError, match=ENV_DOCUMENT_TIMEOUT):
            document_timeout_from_env({ENV_DOCUMENT_TIMEOUT: bad})


def test_restarted_after_the_final_checkpoint_reports_finished_without_a_weight_group(
        redis_client, redis_server, tmp_path, roles):
    """Killed after its final checkpoint (the inference servers may already have left the group on
    training_finished): the restarted trainer has nothing to train and must not wait for ranks that never join."""
    spec = tiny_spec(maxSteps=2, samplesPerStep=4)
    keys = keys_for("again", spec)
    first = start_trainer(roles, tmp_path, "again", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))
    assert first.wait(START_TIMEOUT) == 0, first.log()
    (done,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    redis_client.delete(keys.events)  # so that every event below is the second process's

    second = start_trainer(roles, tmp_path, "again", spec, redis_server.url,
                           **{runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{free_port()}"})  # nobody will ever join
    assert second.wait(START_TIMEOUT) == 0, second.log()
    events = read_events(redis_client, keys)
    assert [e.type for e in events] == [protocol.TRAINING_FINISHED], second.log()
    again = events[0].payload
    assert again["step"] == 2 and again["interrupted"] is False
    assert again["checkpoint"] == done.payload["checkpoint"] and again["documents_seen"] == 8
