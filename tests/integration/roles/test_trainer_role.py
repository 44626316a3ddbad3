"""The trainer role as a real subprocess (`python -m rlkube.core.trainer`) against a real Redis."""

from __future__ import annotations

import signal
import time

import torch
from support.core_roles import (
    add_documents,
    keys_for,
    make_documents,
    read_events,
    role_env,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_trainer,
    tiny_spec,
    wait_for,
    wait_for_event,
)
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol, runtime
from support.hf_models import initial_model
from rlkube.core.hf.loading import load_model
from safetensors.torch import load_file

START_TIMEOUT = 60  # python + torch import on a loaded 2-core machine


def test_finished_only_after_the_final_checkpoint_is_complete(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4)
    spec["trainer"]["checkpoint"] = {"intervalSteps": 2}
    keys = keys_for("fin", spec)
    ckpt_dir = tmp_path / "ckpt"
    trainer = start_trainer(roles, tmp_path, "fin", spec, redis_server.url)
    docs = make_documents(12, version=0)
    for i in (1, 2, 9):  # their reward function failed: counted per step in the metrics
        docs[i].reward_error = True
    add_documents(redis_client, keys, docs)
    # Block on the events stream and inspect the checkpoint the moment training_finished arrives.
    last, finished = "0-0", None
    deadline = time.monotonic() + START_TIMEOUT
    while finished is None:
        # short blocks: redis-py 8 clients time out socket reads after 5 s by default
        got = redis_client.xread({keys.events: last}, block=1000)
        assert got or time.monotonic() < deadline, f"no event within {START_TIMEOUT}s:\n{trainer.log()}"
        for sid, fields in got[0][1] if got else []:
            last = sid
            event = protocol.decode_event(sid, fields)
            if event is not None and event.type == protocol.TRAINING_FINISHED:
                finished = event
                path = ckpt.Path(event.payload["checkpoint"])
                meta = ckpt.read_meta(path)  # complete: every file present, meta parses, step matches
                state = load_file(str(path / ckpt.MODEL_FILE))
    assert meta is not None and meta.step == 3 and meta.documents_seen == 12
    assert finished.payload["step"] == 3 and finished.payload["interrupted"] is False
    assert sorted(load_model(path).state_dict()) == sorted(state)  # transformers loads it as it is: an HF directory
    assert trainer.wait(30) == 0, trainer.log()

    types = [e.type for e in read_events(redis_client, keys)]
    assert types[-1] == protocol.TRAINING_FINISHED
    saved = read_events(redis_client, keys, protocol.CHECKPOINT_SAVED)
    assert [e.step for e in saved] == [2, 3]
    assert types.index(protocol.TRAINING_FINISHED) > types.index(protocol.CHECKPOINT_SAVED)
    ready = read_events(redis_client, keys, protocol.WEIGHTS_READY)
    assert [e.payload["version"] for e in ready] == [0, 1, 2, 3]  # one at start, one after every step
    metrics = read_events(redis_client, keys, protocol.METRICS)
    assert [e.step for e in metrics] == [1, 2, 3]
    for m in metrics:
        for key in ("loss", "reward_mean", "lag_max", "tokens", "tokens_per_s", "busy_s", "wait_s", "ratio_mean",
                    "clipped_fraction", "grad_norm", "logprob_diff_abs", "is_ratio_mean", "is_masked_fraction"):
            assert key in m.payload, key
        assert m.payload["tokens"] == 4 * 7
    assert [m.payload["lag_max"] for m in metrics] == [0, 1, 2]  # every document was sampled by version 0
    assert [m.payload["reward_errors"] for m in metrics] == [2, 0, 1]  # documents 1, 2 | - | 9 (4 per step)
    # weights really changed and the checkpoint holds the trained ones
    initial = initial_model(parse_spec(spec).model).state_dict()
    assert any(not torch.equal(initial[k], state[k]) for k in initial)
    # only the last two checkpoints are kept, and no temp directories are left
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["step-000002", "step-000003"]


def test_killed_trainer_resumes_from_its_checkpoint(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=4, samplesPerStep=4)
    spec["trainer"]["checkpoint"] = {"intervalSteps": 2}
    keys = keys_for("resume", spec)
    ckpt_dir = tmp_path / "ckpt"
    first = start_trainer(roles, tmp_path, "resume", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8, version=0, seed=1))
    wait_for_event(redis_client, keys, protocol.CHECKPOINT_SAVED, START_TIMEOUT, first, where=lambda e: e.step == 2)
    first.proc.send_signal(signal.SIGKILL)  # no chance to publish anything
    first.wait(10)
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    saved = load_file(str(ckpt_dir / "step-000002" / ckpt.MODEL_FILE))

    redis_client.delete(keys.events)  # so that every event below is the new process's
    second = start_trainer(roles, tmp_path, "resume", spec, redis_server.url)
    ready = wait_for_event(redis_client, keys, protocol.WEIGHTS_READY, START_TIMEOUT, second)
    assert ready.payload["version"] == 2 and ready.payload["documents_seen"] == 8
    add_documents(redis_client, keys, make_documents(8, version=2, seed=2))
    finished = wait_for_event(redis_client, keys, protocol.TRAINING_FINISHED, START_TIMEOUT, second)
    assert second.wait(30) == 0, second.log()
    assert finished.payload["step"] == 4 and finished.payload["documents_seen"] == 16
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [3, 4]
    assert "resumed from" in second.log()

    # The weights the second process started from are the checkpoint's: retrain steps 3-4 in-process from the
    # step-2 checkpoint on the same documents and compare with the second process's final checkpoint.
    from rlkube.core.trainer import Trainer

    replay = Trainer(parse_spec(spec), checkpoint_dir=tmp_path / "replay")
    ckpt.load_checkpoint_state(ckpt_dir / "step-000002", replay.backend.load_state)
    for k, v in saved.items():
        assert torch.equal(replay.model.state_dict()[k], v)
    docs = make_documents(8, version=2, seed=2)
    replay.train_step(docs[:4])
    replay.train_step(docs[4:])
    final = load_file(str(ckpt_dir / "step-000004" / ckpt.MODEL_FILE))
    for k, v in replay.model.state_dict().items():
        torch.testing.assert_close(v, final[k], rtol=0, atol=1e-6)


def test_sigterm_finishes_the_step_checkpoints_and_reports_interrupted(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=50, samplesPerStep=4)
    keys = keys_for("term", spec)
    trainer = start_trainer(roles, tmp_path, "term", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, START_TIMEOUT, trainer, where=lambda e: e.step == 2)
    trainer.proc.send_signal(signal.SIGTERM)  # now waiting for documents that never come
    assert trainer.wait(30) == 0, trainer.log()
    finished = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert len(finished) == 1
    assert finished[0].payload["interrupted"] is True and finished[0].payload["step"] == 2
    assert ckpt.read_meta(ckpt.Path(finished[0].payload["checkpoint"])).step == 2


def test_a_crash_mid_run_exits_nonzero_without_finished_event(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4)
    spec["trainer"]["checkpoint"] = {"intervalSteps": 1}
    keys = keys_for("crash", spec)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("the first checkpoint save fails here")
    trainer = start_trainer(roles, tmp_path, "crash", spec, redis_server.url, ckpt_dir=blocker)
    add_documents(redis_client, keys, make_documents(12))
    assert trainer.wait(START_TIMEOUT) == 1
    assert "no training_finished published" in trainer.log()
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [1]  # it did train
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert not read_events(redis_client, keys, protocol.CHECKPOINT_SAVED)


def test_malformed_documents_are_logged_and_skipped(redis_client, redis_server, tmp_path, caplog):
    """In-process, to read the log records: bad entries between good ones never crash the trainer."""
    import threading

    from rlkube.contract.context import RoleContext
    from rlkube.core.trainer import build_role

    spec = tiny_spec(maxSteps=1, samplesPerStep=4)
    env = role_env(tmp_path, "junk", spec, redis_server.url, **{runtime.ENV_CHECKPOINT_DIR: str(tmp_path / "c")})
    ctx = RoleContext.from_env(env)
    keys = ctx.keys
    good = make_documents(4)
    redis_client.xadd(keys.documents, {"nothing": b"here"})
    add_documents(redis_client, keys, good[:2])
    redis_client.xadd(keys.documents, {"tokens": b"\x01\x02\x03", "data": b"{}"})  # not whole int64s
    redis_client.xadd(keys.documents, {"tokens": good[0].tokens.tobytes(), "data": b"{not json"})
    redis_client.xadd(keys.documents, {"tokens": good[0].tokens.tobytes(),
                                       "data": b'{"loss_masking_spans": [[0, 99]], "advantage": 1.0}'})
    too_long = make_documents(1, prompt_len=30, completion_len=10)[0]  # 40 > maxSequenceLength 32
    add_documents(redis_client, keys, [too_long])
    add_documents(redis_client, keys, good[2:])
    role = build_role(ctx, redis_client, threading.Event())
    caplog.set_level("WARNING", logger="rlkube.trainer")
    assert role.run() == 0
    assert role.skipped == 5
    skipped = [r.getMessage() for r in caplog.records if "skipping malformed document" in r.getMessage()]
    assert len(skipped) == 5
    assert any("maxSequenceLength" in m for m in skipped)
    assert any("not JSON" in m for m in skipped)
    metrics = read_events(redis_client, keys, protocol.METRICS)
    assert len(metrics) == 1 and metrics[0].payload["documents_skipped"] == 5
    assert wait_for(lambda: read_events(redis_client, keys, protocol.TRAINING_FINISHED), 1, "finished")


def test_a_redis_that_lost_its_streams_is_read_again_after_recreating_the_group(
        redis_client, redis_server, tmp_path, roles):
    """A managed Redis restarted empty: the documents group is gone. The trainer creates it again and trains on
    the next documents instead of crashing (which would cost a restart and the steps since its checkpoint)."""
    spec = tiny_spec(maxSteps=2, samplesPerStep=4)
    keys = keys_for("emptied", spec)
    trainer = start_trainer(roles, tmp_path, "emptied", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(4, seed=1))
    wait_for_event(redis_client, keys, protocol.METRICS, START_TIMEOUT, trainer, where=lambda e: e.step == 1)
    redis_client.flushall()  # the trainer is waiting for step 2's documents in XREADGROUP right now
    # The events went too: the trainer announces its weights anew once it has recreated the group.
    again = wait_for_event(redis_client, keys, protocol.WEIGHTS_READY, START_TIMEOUT, trainer)
    assert again.payload["version"] == 1 and again.payload["documents_seen"] == 4
    assert "creating it again" in trainer.log()
    add_documents(redis_client, keys, make_documents(4, seed=2))
    assert trainer.wait(START_TIMEOUT) == 0, trainer.log()
    finished = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert [e.step for e in finished] == [2] and finished[0].payload["documents_seen"] == 8, trainer.log()
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [2]
