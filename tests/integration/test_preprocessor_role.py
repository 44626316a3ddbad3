"""The preprocessor role against a real Redis: stops on training_finished (never on counts), backpressure,
partial groups, malformed entries."""

from __future__ import annotations

import signal
import threading

import orjson
import pytest
from core_roles import Role, keys_for, make_group, role_env, tiny_spec, wait_for
from rlkube.core import protocol
from rlkube.core.preprocessor import PreprocessorRole, position_key
from rlkube.core.runtime import RoleContext
from rlkube.core.trainer import ensure_group

START_TIMEOUT = 60


@pytest.fixture
def roles():
    started: list[Role] = []
    yield started
    for r in started:
        r.kill()


def consume(client, keys, consumer="fast_llm_consumer_0") -> int:
    """Read documents as the trainer does (group, noack), so backpressure lets the preprocessor go on."""
    got = client.xreadgroup(protocol.DOCUMENTS_GROUP, consumer, {keys.documents: ">"}, count=1000, noack=True)
    return sum(len(entries) for _, entries in got or [])


def test_runs_past_any_sample_count_and_stops_only_on_training_finished(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=2, samplesPerStep=4, groupSize=4)
    keys = keys_for("stop", spec)
    ensure_group(redis_client, keys)
    role = Role("rlkube.core.preprocessor", role_env(tmp_path, "stop", spec, redis_server.url), tmp_path / "pre.log")
    roles.append(role)
    # 6 groups x 4 = 24 samples: three times maxSteps x samplesPerStep
    for i in range(6):
        redis_client.xadd(keys.rollouts, make_group(f"g{i}", [0.1 * i, 0.5, 0.9, 0.2], expected=4).encode())
    read = [0]

    def all_read(n):
        read[0] += consume(redis_client, keys)
        return read[0] == n

    wait_for(lambda: all_read(24), START_TIMEOUT, "24 documents", role)
    assert role.proc.poll() is None, "the preprocessor stopped after counting samples"
    # still working: a later group still becomes documents
    redis_client.xadd(keys.rollouts, make_group("late", [0.0, 1.0, 1.0, 0.0], expected=4).encode())
    wait_for(lambda: all_read(28), 30, "the late group's documents", role)
    assert role.proc.poll() is None
    redis_client.xadd(keys.events, protocol.training_finished(step=2, checkpoint="/x", interrupted=False))
    assert role.wait(15) == 0
    assert "training_finished" in role.log()


def test_sigterm_exits_zero_promptly(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec()
    keys = keys_for("term", spec)
    role = Role("rlkube.core.preprocessor", role_env(tmp_path, "term", spec, redis_server.url), tmp_path / "pre.log")
    roles.append(role)
    wait_for(lambda: "reading" in role.log(), START_TIMEOUT, "start-up", role)
    role.proc.send_signal(signal.SIGTERM)
    assert role.wait(10) == 0
    assert redis_client.xlen(keys.documents) == 0


def _ctx(tmp_path, redis_server, job, **algorithm):
    spec = tiny_spec(**algorithm)
    return RoleContext.from_env(role_env(tmp_path, job, spec, redis_server.url))


def test_backpressure_holds_until_the_trainer_reads(redis_client, redis_server, tmp_path):
    ctx = _ctx(tmp_path, redis_server, "bp", samplesPerStep=4, groupSize=4)  # bound: 2 x 4 = 8 unread documents
    keys = ctx.keys
    for i in range(10):
        redis_client.xadd(keys.rollouts, make_group(f"g{i}", [0.0, 1.0, 0.5, 0.25], expected=4).encode())
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    assert pre.max_ahead == 8
    # before the trainer's group exists nothing counts as read
    for _ in range(4):
        pre.poll()
    assert redis_client.xlen(keys.documents) == 8
    assert pre.holds >= 2
    ensure_group(redis_client, keys)
    holds = pre.holds
    for _ in range(3):
        pre.poll()
    assert redis_client.xlen(keys.documents) == 8 and pre.holds == holds + 3  # still nothing read: holding
    assert consume_n(redis_client, keys, 4) == 4  # the trainer reads 4 -> room for one group of 4
    pre.poll()
    assert redis_client.xlen(keys.documents) == 12
    pre.poll()
    assert redis_client.xlen(keys.documents) == 12
    consume(redis_client, keys)  # reads everything
    pre.poll()
    assert redis_client.xlen(keys.documents) == 20
    # training_finished stops it even while it is holding
    redis_client.xadd(keys.events, protocol.training_finished(step=1))
    pre.poll()
    assert pre.finished and pre.run() == 0
    assert redis_client.xlen(keys.documents) == 20


def consume_n(client, keys, n):
    got = client.xreadgroup(protocol.DOCUMENTS_GROUP, "fast_llm_consumer_0", {keys.documents: ">"}, count=n, noack=True)
    return sum(len(entries) for _, entries in got or [])


def test_partial_groups_malformed_entries_and_unknown_events(redis_client, redis_server, tmp_path, caplog):
    ctx = _ctx(tmp_path, redis_server, "junk", groupSize=8, samplesPerStep=32)
    keys = ctx.keys
    ensure_group(redis_client, keys)
    redis_client.xadd(keys.rollouts, {"unrelated": b"field"})
    redis_client.xadd(keys.rollouts, {"group": b"{not json"})
    redis_client.xadd(keys.rollouts, {"group": orjson.dumps({"group_id": "x", "samples": []})})
    redis_client.xadd(keys.rollouts, make_group("partial", [0.0, 0.5, 1.0], expected=8, version=4).encode())
    redis_client.xadd(keys.rollouts, make_group("single", [0.7], expected=8).encode())
    redis_client.xadd(keys.events, {"event": b"{not json"})
    redis_client.xadd(keys.events, {"event": orjson.dumps({"type": "mystery", "step": 1})})
    redis_client.xadd(keys.events, {"no-event-field": b"1"})
    caplog.set_level("INFO")
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    wait_for(lambda: (pre.poll(), pre.groups == 2)[1], 10, "the two valid groups")
    assert pre.skipped == 3 and not pre.finished
    assert sum("skipping rollout entry" in r.getMessage() for r in caplog.records) == 3
    assert sum("skipping event" in r.getMessage() for r in caplog.records) == 2
    assert any("unknown type 'mystery'" in r.getMessage() for r in caplog.records)
    docs = [protocol.decode_document(f) for _, f in redis_client.xrange(keys.documents)]
    assert len(docs) == 3  # the partial group's three samples; the singleton has no baseline and is dropped
    assert [d.advantage for d in docs] == pytest.approx([-0.75, 0.0, 0.75])
    assert all(d.model_version.tolist() == [4] * len(d.tokens) for d in docs)
    assert any("partial: 3 of 8" in r.getMessage() for r in caplog.records)
    redis_client.xadd(keys.events, protocol.training_finished(step=1))
    assert pre.run() == 0 and pre.finished


def test_a_restarted_preprocessor_continues_where_it_stopped(redis_client, redis_server, tmp_path):
    """The read position survives the process: a new instance (a restart) writes no duplicate documents."""
    ctx = _ctx(tmp_path, redis_server, "restart", samplesPerStep=32, groupSize=4)
    keys = ctx.keys
    ensure_group(redis_client, keys)
    for i in range(3):
        redis_client.xadd(keys.rollouts, make_group(f"a{i}", [0.0, 1.0, 0.5, 0.25], expected=4).encode())
    redis_client.xadd(keys.rollouts, {"group": b"{not json"})  # skipped, but read: the position passes it
    first = PreprocessorRole(ctx, redis_client, threading.Event())
    wait_for(lambda: (first.poll(), first.groups == 3 and first.skipped == 1)[1], 10, "the first three groups")
    assert redis_client.xlen(keys.documents) == 12
    last_id = redis_client.xrevrange(keys.rollouts, count=1)[0][0].decode()
    assert redis_client.get(position_key(keys)).decode() == last_id

    second = PreprocessorRole(ctx, redis_client, threading.Event())  # the restarted process
    assert second.rollouts_pos == last_id
    for _ in range(3):
        second.poll()
    assert redis_client.xlen(keys.documents) == 12, "a restart replayed rollouts already turned into documents"
    redis_client.xadd(keys.rollouts, make_group("b0", [1.0, 0.0, 0.0, 1.0], expected=4).encode())
    wait_for(lambda: (second.poll(), second.groups == 1)[1], 10, "the group written after the restart")
    docs = [protocol.decode_document(f) for _, f in redis_client.xrange(keys.documents)]
    assert len(docs) == 16
    assert [d.reward for d in docs[12:]] == [1.0, 0.0, 0.0, 1.0]


def test_documents_and_position_are_written_together(redis_client, redis_server, tmp_path):
    """One MULTI/EXEC: a crash can never leave documents without the position that covers them."""
    ctx = _ctx(tmp_path, redis_server, "atomic", samplesPerStep=32, groupSize=4)
    keys = ctx.keys
    redis_client.xadd(keys.rollouts, make_group("a", [0.0, 1.0, 0.5, 0.25], expected=4).encode())
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    with redis_server.client().monitor() as monitor:
        wait_for(lambda: (pre.poll(), pre.groups == 1)[1], 10, "one group")
        commands = []
        for cmd in monitor.listen():
            commands.append(cmd["command"].split()[0].upper())
            if commands[-1] == "EXEC":
                break
    tail = commands[commands.index("MULTI"):]
    assert tail == ["MULTI", "XADD", "XADD", "XADD", "XADD", "SET", "EXEC"], tail
