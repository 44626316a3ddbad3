"""The sample tables' path through Redis (docs/design.md §5.7), on a real redis-server: the preprocessor's Lua step
writes each document's record beside it, the trainer's keeper turns a due step's documents into rows (with what only
the record knows) and deletes the records of every document read; evaluation rows arrive on their stream and are
written once per version, also by a restarted trainer, which keeps no step twice either; the finished trainer waits
(bounded) for the final evaluation's rows, trackers or not; the file never passes maxBytes."""

from __future__ import annotations

import json
import logging
import threading

import orjson
from support.core_roles import make_group, role_env, tiny_spec, wait_for
from rlkube.api.spec import SamplesSpec
from rlkube.contract import protocol
from rlkube.contract import samples as contract
from rlkube.contract.context import RoleContext
from rlkube.core.preprocessor.role import PreprocessorRole
from rlkube.core.trainer.samples import SampleKeeper


def decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


class Tables:
    def __init__(self):
        self.logged: list[tuple[str, int, int]] = []

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        self.logged.append((name, len(rows), step))


def _read_documents(client, keys):
    got = client.xreadgroup(protocol.DOCUMENTS_GROUP, "fast_llm_consumer_0", {keys.documents: ">"}, count=100)
    docs = []
    for _, entries in got or []:
        for sid, fields in entries:
            doc = protocol.decode_document(fields)
            doc.stream_id = sid.decode()
            docs.append(doc)
    return docs


def test_a_due_steps_rows_carry_the_records_and_every_read_documents_record_is_deleted(redis_client, redis_server,
                                                                                       tmp_path):
    ctx = RoleContext.from_env(role_env(tmp_path, "samples", tiny_spec(samplesPerStep=8, groupSize=4), redis_server.url))
    keys = ctx.keys
    redis_client.xgroup_create(keys.documents, protocol.DOCUMENTS_GROUP, id="0", mkstream=True)
    group = make_group("g-1", [0.0, 1.0, 0.5, 0.25], expected=4, version=3)
    group.samples[1].finished = False
    group.samples[2].env_spans = [(1, 2)]
    group.samples[2].episode = {"turns": 2, "tool_calls": 1, "truncated": 1}
    group.actor = "actor-0"
    redis_client.xadd(keys.rollouts, group.encode())
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    wait_for(lambda: (pre.poll(), pre.groups == 1)[1], 10, "one group")
    assert redis_client.hlen(keys.sample_records) == 4
    docs = _read_documents(redis_client, keys)
    assert len(docs) == 4

    tables = Tables()
    keeper = SampleKeeper(SamplesSpec(everySteps=10, perStep=4), redis_client, keys, tmp_path / "out", decode, tables)
    assert keeper.keep_step(9, 4, docs) == []  # not due
    rows = keeper.keep_step(10, 4, docs)
    keeper.forget(docs)
    assert redis_client.hlen(keys.sample_records) == 0
    assert len(rows) == 4 and tables.logged == [("samples", 4, 10)]
    by_reward = {r["reward"]: r for r in rows}
    assert by_reward[0.0]["finish_reason"] == "stop" and by_reward[1.0]["finish_reason"] == "length"
    episode = by_reward[0.5]
    assert episode["finish_reason"] == "truncated" and episode["episode"]["tool_calls"] == 1
    assert [(t["role"], t["masked"]) for t in episode["turns"]] == [
        ("model", False), ("environment", True), ("model", False)]
    for r in rows:
        assert r["group"] == "g-1" and r["weight_version"] == 3 and r["lag"] == 1 and r["step"] == 10, r
        assert r["prompt"] == decode([1, 4, 5, 16]) and r["tokens"] == {"prompt": 4, "completion": 3}
    # Leave-one-out advantages: the best sample's is positive, the worst's negative.
    assert by_reward[1.0]["advantage"] > 0 > by_reward[0.0]["advantage"]
    assert list(contract.read_rows(keeper.path)) == json.loads(json.dumps(rows))


def test_evaluation_rows_are_written_once_per_version_also_after_a_restart(redis_client, tmp_path):
    keys = protocol.StreamKeys.for_job("ns", "eval")
    spec = SamplesSpec(everySteps=5, perStep=2)

    def send(version: int, n: int) -> None:
        rows = [{"kind": "evaluation", "version": version, "step": version, "prompt": f"p{i}", "reward": 0.5}
                for i in range(n)]
        redis_client.xadd(keys.evaluation_samples, {contract.EVALUATION_FIELD: orjson.dumps(
            {"version": version, "rows": rows})})

    send(0, 2)
    send(5, 2)
    redis_client.xadd(keys.evaluation_samples, {contract.EVALUATION_FIELD: b"not json"})  # skipped
    tables = Tables()
    keeper = SampleKeeper(spec, redis_client, keys, tmp_path, decode, tables)
    assert len(keeper.drain_evaluations(5)) == 4
    assert tables.logged == [("evaluation_samples", 2, 0), ("evaluation_samples", 2, 5)]
    send(5, 2)  # sent again (an actor that restarted mid-report): not written twice
    assert keeper.drain_evaluations(6) == []
    again = SampleKeeper(spec, redis_client, keys, tmp_path, decode)  # a restarted trainer reads from the start
    send(10, 1)
    assert [r["version"] for r in again.drain_evaluations(10)] == [10]
    assert [r["version"] for r in contract.read_rows(tmp_path / contract.FILE)] == [0, 0, 5, 5, 10]
    send(15, 0)  # every kept prompt skipped: no rows, but the version is done (the finished trainer waits for it)
    assert again.drain_evaluations(15) == [] and 15 in again.eval_done


def test_a_trainer_restarted_from_an_older_checkpoint_keeps_each_step_once(redis_client, tmp_path):
    """Killed after keeping step 4 but before its checkpoint, the trainer trains steps 3-4 again from step 2's: the
    file keeps the first rows of step 4 (the file is only appended to) and goes on with step 6."""
    import numpy as np

    keys = protocol.StreamKeys.for_job("ns", "restart")
    spec = SamplesSpec(everySteps=2, perStep=1)

    def doc(sid: str, reward: float) -> protocol.Document:
        return protocol.Document(tokens=np.arange(6, dtype=np.int64), loss_masking_spans=[(0, 3)], advantage=0.0,
                                 reward=reward, stream_id=sid)

    first = SampleKeeper(spec, redis_client, keys, tmp_path, decode)
    assert len(first.keep_step(2, 1, [doc("1-0", 0.25)])) == 1
    assert len(first.keep_step(4, 3, [doc("2-0", 0.5)])) == 1
    again = SampleKeeper(spec, redis_client, keys, tmp_path, decode)  # the restarted trainer, resumed at step 2
    assert again.keep_step(4, 3, [doc("3-0", 1.0)]) == []
    assert len(again.keep_step(6, 5, [doc("4-0", 1.0)])) == 1
    rows = list(contract.read_rows(tmp_path / contract.FILE))
    assert [(r["step"], r["reward"]) for r in rows] == [(2, 0.25), (4, 0.5), (6, 1.0)]


def test_a_new_job_on_a_reused_claim_keeps_its_own_steps_and_a_restart_of_it_keeps_each_once(redis_client, tmp_path):
    """The claim still holds an earlier job's samples.jsonl (steps 2 and 4, versions 0 and 2 evaluated): a new job
    (another uid) keeps its steps 2 and 4 and evaluates its versions all the same; its restarted trainer (the same
    uid) keeps none of them twice. A reader asking for the new job's rows gets its rows only."""
    import numpy as np

    keys = protocol.StreamKeys.for_job("ns", "reused")
    spec = SamplesSpec(everySteps=2, perStep=1)

    def doc(sid: str, reward: float) -> protocol.Document:
        return protocol.Document(tokens=np.arange(6, dtype=np.int64), loss_masking_spans=[(0, 3)], advantage=0.0,
                                 reward=reward, stream_id=sid)

    def evaluated(version: int) -> None:
        redis_client.xadd(keys.evaluation_samples, {contract.EVALUATION_FIELD: orjson.dumps(
            {"version": version, "rows": [{"kind": "evaluation", "version": version, "step": version}]})})

    old = SampleKeeper(spec, redis_client, keys, tmp_path, decode, run="uid-old")
    evaluated(0)
    assert len(old.keep_step(2, 1, [doc("1-0", 0.1)])) == 1 and len(old.keep_step(4, 3, [doc("2-0", 0.2)])) == 1
    assert [r["version"] for r in old.drain_evaluations(4)] == [0]
    redis_client.delete(keys.evaluation_samples)  # the new job's own Redis

    new = SampleKeeper(spec, redis_client, keys, tmp_path, decode, run="uid-new")
    evaluated(0)
    assert [r["run"] for r in new.keep_step(2, 1, [doc("3-0", 0.5)])] == ["uid-new"]
    assert [r["run"] for r in new.drain_evaluations(2)] == ["uid-new"]
    restarted = SampleKeeper(spec, redis_client, keys, tmp_path, decode, run="uid-new")
    assert restarted.keep_step(2, 1, [doc("4-0", 0.7)]) == [] and restarted.drain_evaluations(2) == []
    assert len(restarted.keep_step(4, 3, [doc("5-0", 0.9)])) == 1
    rows = list(contract.read_rows(tmp_path / contract.FILE))
    mine = contract.of_run(rows, "uid-new")
    assert [(r["kind"], r["step"], r["reward"] if r["kind"] == contract.TRAIN else None) for r in mine] == [
        ("train", 2, 0.5), ("evaluation", 0, None), ("train", 4, 0.9)]
    assert len(rows) == len(mine) + 3  # the earlier job's rows stay (the file is only appended to)
    assert contract.kept_steps(tmp_path / contract.FILE, "uid-new") == {2, 4}


def test_the_file_stops_at_max_bytes_and_training_rows_are_cut_at_max_text_chars(redis_client, tmp_path):
    keys = protocol.StreamKeys.for_job("ns", "bound")
    spec = SamplesSpec(everySteps=1, perStep=1, maxBytes=4096, maxTextChars=16)
    tables = Tables()
    keeper = SampleKeeper(spec, redis_client, keys, tmp_path, decode, tables)
    import numpy as np

    doc = protocol.Document(tokens=np.arange(200, dtype=np.int64), loss_masking_spans=[(0, 100)], advantage=0.5,
                            reward=1.0, model_version=np.zeros(200, dtype=np.int64), stream_id="1-0")
    for step in range(1, 200):
        keeper.keep_step(step, step, [doc])
    size = (tmp_path / contract.FILE).stat().st_size
    rows = list(contract.read_rows(tmp_path / contract.FILE))
    assert size <= 4096 and 0 < len(rows) < 199 and keeper.file.dropped == 199 - len(rows)
    assert all(len(r["prompt"]) == 16 and r["truncated"] for r in rows)
    assert [step for _, _, step in tables.logged] == [r["step"] for r in rows]  # the trackers: what the file took


class _Actor0(logging.Handler):
    """Scores the final version only once the finished trainer says it waits for it (as actor 0 does after the
    final weights_ready, taking its time): sends the result, then the rows, from another thread."""

    def __init__(self, client, keys: protocol.StreamKeys):
        super().__init__()
        self.client, self.keys, self.sent = client, keys, []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("waiting up to"):
            threading.Thread(target=self.send, args=(record.args[1],)).start()

    def send(self, version: int) -> None:
        self.client.xadd(self.keys.events, protocol.encode_event(protocol.EVALUATION, version=version,
                                                                 reward_mean=0.5, prompts=2))
        rows = [{"kind": "evaluation", "version": version, "step": version, "prompt": f"p{i}", "reward": 0.5}
                for i in range(2)]
        self.client.xadd(self.keys.evaluation_samples, {contract.EVALUATION_FIELD: orjson.dumps(
            {"version": version, "rows": rows})})
        self.sent.append(version)


def _evaluated_trainer(tmp_path, redis_server, redis_client, job: str, completion_timeout_s: int):
    from support.core_roles import add_documents, make_documents
    from rlkube.contract import runtime
    from rlkube.core.trainer import build_role

    spec = tiny_spec(maxSteps=1, samplesPerStep=4)
    spec["evaluation"] = {"everyVersions": 1, "prompts": 2}
    spec["samples"] = {"everySteps": 1, "perStep": 2}
    spec.setdefault("runPolicy", {})["completionTimeoutSeconds"] = completion_timeout_s
    env = role_env(tmp_path, job, spec, redis_server.url, **{runtime.ENV_CHECKPOINT_DIR: str(tmp_path / "c")})
    ctx = RoleContext.from_env(env)
    add_documents(redis_client, ctx.keys, make_documents(4))
    return ctx, build_role(ctx, redis_client, threading.Event())


def test_the_final_evaluations_rows_reach_the_file_without_trackers(redis_client, redis_server, tmp_path):
    """No spec.tracking: the finished trainer still waits (bounded) for the final version's evaluation rows."""
    ctx, role = _evaluated_trainer(tmp_path, redis_server, redis_client, "final-eval", 120)
    assert not role.trackers.workers
    actor0 = _Actor0(redis_client, ctx.keys)
    logger = logging.getLogger("rlkube.trainer")
    logger.addHandler(actor0)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        assert role.run() == 0
    finally:
        logger.removeHandler(actor0)
        logger.setLevel(old_level)
    assert actor0.sent == [1]
    rows = list(contract.read_rows(role.samples.path))
    assert [(r["kind"], r["version"]) for r in rows if r["kind"] == contract.EVALUATION] == [("evaluation", 1)] * 2
    finished = [e for e in _events(redis_client, ctx.keys) if e.type == protocol.TRAINING_FINISHED]
    assert len(finished) == 1 and finished[0].step == 1


def test_without_the_final_evaluation_the_trainer_finishes_after_the_bound(redis_client, redis_server, tmp_path,
                                                                           caplog):
    """Nobody evaluates: the wait ends at half of completionTimeoutSeconds (2 s here) and training_finished goes."""
    ctx, role = _evaluated_trainer(tmp_path, redis_server, redis_client, "no-eval", 2)
    caplog.set_level("INFO", logger="rlkube.trainer")
    assert role.run() == 0
    assert any("no evaluation of version 1 within 1s" in r.getMessage() for r in caplog.records)
    assert not [r for r in contract.read_rows(role.samples.path) if r["kind"] == contract.EVALUATION]
    assert [e.type for e in _events(redis_client, ctx.keys)].count(protocol.TRAINING_FINISHED) == 1


def _events(client, keys: protocol.StreamKeys) -> list[protocol.TrainerEvent]:
    return [e for sid, fields in client.xrange(keys.events)
            if (e := protocol.decode_event(sid, fields)) is not None]
