"""The preprocessor role against a real Redis: stops on training_finished (never on counts), backpressure,
partial groups, malformed entries, and exactly-once over the rollouts consumer group (restarts, several
replicas at once, entries a dead replica left pending)."""

from __future__ import annotations

import collections
import re
import signal
import threading

import orjson
import pytest
from support.core_roles import (
    Role,
    keys_for,
    make_documents,
    make_group,
    role_env,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_role,
    tiny_spec,
    wait_for,
)
from rlkube.contract import protocol
from rlkube.core.preprocessor.role import PreprocessorRole
from rlkube.contract.context import RoleContext
from rlkube.contract.streams import ensure_group

START_TIMEOUT = 60


def rollouts_state(client, keys) -> dict:
    """The preprocessors' consumer group on the rollouts stream: XINFO GROUPS entry with decoded names."""
    (group,) = [g for g in client.xinfo_groups(keys.rollouts) if g["name"] == protocol.ROLLOUTS_GROUP.encode()]
    return group


def rollouts_done(client, keys) -> bool:
    """Every rollout entry was delivered to a preprocessor and acknowledged (its documents are written)."""
    last = client.xrevrange(keys.rollouts, count=1)[0][0]
    group = rollouts_state(client, keys)
    return group["last-delivered-id"] == last and group["pending"] == 0


def documents_per_version(client, keys) -> collections.Counter:
    """How many documents each group produced (the tests give every group its own model_version)."""
    docs = [protocol.decode_document(f) for _, f in client.xrange(keys.documents)]
    assert all(len(set(d.model_version.tolist())) == 1 for d in docs)
    return collections.Counter(int(d.model_version[0]) for d in docs)


def consume(client, keys, consumer="fast_llm_consumer_0") -> int:
    """Read documents as the trainer does (group, noack), so backpressure lets the preprocessor go on."""
    got = client.xreadgroup(protocol.DOCUMENTS_GROUP, consumer, {keys.documents: ">"}, count=1000, noack=True)
    return sum(len(entries) for _, entries in got or [])


def test_runs_past_any_sample_count_and_stops_only_on_training_finished(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=2, samplesPerStep=4, groupSize=4)
    keys = keys_for("stop", spec)
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
    role = start_role(roles, "preprocessor", tmp_path, "stop", spec, redis_server.url)
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
    role = start_role(roles, "preprocessor", tmp_path, "term", spec, redis_server.url)
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
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
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
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
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
    assert rollouts_done(redis_client, keys)  # the skipped entries are acknowledged too: never re-read
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


def test_malformed_entries_are_acknowledged_and_a_new_instance_writes_no_duplicates(redis_client, redis_server,
                                                                                   tmp_path):
    """Everything read is acknowledged (skipped entries too), so a new instance of the same replica (a restart)
    replays nothing; an entry read but not written before a crash is written exactly once by the next one."""
    ctx = _ctx(tmp_path, redis_server, "restart", samplesPerStep=32, groupSize=4)
    keys = ctx.keys
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
    for i in range(3):
        redis_client.xadd(keys.rollouts, make_group(f"a{i}", [0.0, 1.0, 0.5, 0.25], expected=4, version=i).encode())
    redis_client.xadd(keys.rollouts, {"group": b"{not json"})  # skipped, but acknowledged
    first = PreprocessorRole(ctx, redis_client, threading.Event())
    wait_for(lambda: (first.poll(), first.groups == 3 and first.skipped == 1)[1], 10, "the first three groups")
    assert redis_client.xlen(keys.documents) == 12
    assert rollouts_done(redis_client, keys)

    second = PreprocessorRole(ctx, redis_client, threading.Event())  # the restarted process
    for _ in range(3):
        second.poll()
    assert redis_client.xlen(keys.documents) == 12, "a restart replayed rollouts already turned into documents"
    assert second.groups == 0 and second.pending_from is None

    # A crash between reading and writing: the entry stays pending for this replica's consumer ...
    redis_client.xadd(keys.rollouts, make_group("b0", [1.0, 0.0, 0.0, 1.0], expected=4, version=7).encode())
    got = redis_client.xreadgroup(protocol.ROLLOUTS_GROUP, second.consumer, {keys.rollouts: ">"}, count=10)
    assert len(got[0][1]) == 1 and rollouts_state(redis_client, keys)["pending"] == 1
    # ... and the next run writes it first, once.
    third = PreprocessorRole(ctx, redis_client, threading.Event())
    third.poll()
    assert third.groups == 1 and rollouts_done(redis_client, keys)
    for _ in range(2):
        third.poll()
    assert documents_per_version(redis_client, keys) == {0: 4, 1: 4, 2: 4, 7: 4}
    docs = [protocol.decode_document(f) for _, f in redis_client.xrange(keys.documents)]
    assert [d.reward for d in docs[12:]] == [1.0, 0.0, 0.0, 1.0]


def test_documents_and_the_acknowledgement_are_one_atomic_step(redis_client, redis_server, tmp_path):
    """One Lua script writes a group's documents and acknowledges its entry: a crash leaves both or neither.
    Nothing is written outside it."""
    ctx = _ctx(tmp_path, redis_server, "atomic", samplesPerStep=32, groupSize=4)
    keys = ctx.keys
    redis_client.xadd(keys.rollouts, make_group("a", [0.0, 1.0, 0.5, 0.25], expected=4).encode())
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    with redis_server.client().monitor() as monitor:
        wait_for(lambda: (pre.poll(), pre.groups == 1)[1], 10, "one group")
        commands = []
        for cmd in monitor.listen():
            commands.append((cmd["client_type"], cmd["command"].split()[0].upper()))
            if commands[-1] == ("lua", "XACK"):
                break
    in_script = [name for kind, name in commands if kind == "lua"]
    # Each document with its record for the trainer's sample tables (spec.samples, on by default).
    assert in_script == ["XPENDING", *["XADD", "HSET"] * 4, "XACK"], commands
    outside = [name for kind, name in commands if kind != "lua"]
    assert "EVALSHA" in outside and "XADD" not in outside and "XACK" not in outside, commands
    assert rollouts_done(redis_client, keys) and redis_client.xlen(keys.documents) == 4


def test_an_entry_claimed_by_another_replica_is_not_written(redis_client, redis_server, tmp_path):
    """The commit checks ownership: a replica that stalled past the claim time and lost its entry to another
    writes nothing for it (the other one does)."""
    ctx = _ctx(tmp_path, redis_server, "fence", samplesPerStep=32, groupSize=4)
    keys = ctx.keys
    pre = PreprocessorRole(ctx, redis_client, threading.Event())
    sid = redis_client.xadd(keys.rollouts, make_group("a", [0.0, 1.0, 0.5, 0.25], expected=4).encode()).decode()
    redis_client.xreadgroup(protocol.ROLLOUTS_GROUP, "preprocessor-5", {keys.rollouts: ">"}, count=1)
    docs = make_documents(4)
    assert pre.commit(sid, docs) is False
    assert redis_client.xlen(keys.documents) == 0
    assert redis_client.xpending(keys.rollouts, protocol.ROLLOUTS_GROUP)["consumers"] == [
        {"name": b"preprocessor-5", "pending": 1}]
    redis_client.xclaim(keys.rollouts, protocol.ROLLOUTS_GROUP, pre.consumer, 0, [sid])
    assert pre.commit(sid, docs) is True
    assert redis_client.xlen(keys.documents) == 4 and rollouts_state(redis_client, keys)["pending"] == 0
    assert pre.commit(sid, docs) is False  # acknowledged: a second commit of the same entry writes nothing
    assert redis_client.xlen(keys.documents) == 4


def test_entries_left_pending_by_a_dead_replica_are_claimed_after_the_idle_time(redis_client, redis_server,
                                                                                tmp_path):
    ctx = _ctx(tmp_path, redis_server, "claim", samplesPerStep=64, groupSize=4)
    keys = ctx.keys
    for i in range(10):
        redis_client.xadd(keys.rollouts, make_group(f"g{i}", [0.0, 1.0, 0.5, 0.25], expected=4, version=i).encode())
    pre = PreprocessorRole(ctx, redis_client, threading.Event(), claim_idle_ms=60_000)
    # replica 1 reads three entries and dies before writing them
    redis_client.xreadgroup(protocol.ROLLOUTS_GROUP, "preprocessor-1", {keys.rollouts: ">"}, count=3)
    wait_for(lambda: (pre.poll(), pre.groups == 7)[1], 10, "the seven entries nobody had read")
    pre.poll()
    assert pre.groups == 7 and pre.claimed == 0  # not idle long enough: a live replica may be writing them
    assert rollouts_state(redis_client, keys)["pending"] == 3
    pre.claim_idle_ms = 100
    wait_for(lambda: (pre.poll(), pre.groups == 10)[1], 10, "the dead replica's three entries")
    assert pre.claimed == 3 and rollouts_done(redis_client, keys)
    assert documents_per_version(redis_client, keys) == {i: 4 for i in range(10)}


def _stopped_after(role: Role) -> int:
    """Groups a role process wrote, from its training_finished log line."""
    (groups,) = re.findall(r"stopping after (\d+) groups", role.log())
    return int(groups)


def test_two_replicas_at_once_write_each_group_exactly_once(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(samplesPerStep=256, groupSize=4)  # room for every document: no backpressure here
    keys = keys_for("two", spec)
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
    replicas = [start_role(roles, "preprocessor", tmp_path, "two", spec, redis_server.url, RLKUBE_INDEX=str(i))
                for i in range(2)]
    for r in replicas:
        wait_for(lambda r=r: "reading" in r.log(), START_TIMEOUT, "start-up", r)
    # Bursts while both replicas wait on the group: each XADD wakes one of them.
    n = 0
    for _ in range(4):
        pipe = redis_client.pipeline(transaction=False)
        for _ in range(10):
            pipe.xadd(keys.rollouts, make_group(f"g{n}", [0.0, 1.0, 0.5, 0.25], expected=4, version=n).encode())
            n += 1
        pipe.execute()
        wait_for(lambda: rollouts_done(redis_client, keys), 30, "every rollout acknowledged", replicas[0])
    assert documents_per_version(redis_client, keys) == {i: 4 for i in range(40)}
    consumers = {c["name"].decode() for c in redis_client.xinfo_consumers(keys.rollouts, protocol.ROLLOUTS_GROUP)}
    assert consumers == {"preprocessor-0", "preprocessor-1"}
    redis_client.xadd(keys.events, protocol.training_finished(step=1))
    assert [r.wait(15) for r in replicas] == [0, 0]
    written = [_stopped_after(r) for r in replicas]
    assert sum(written) == 40 and min(written) > 0, written


def test_a_killed_replica_restarts_without_duplicates_or_losses(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(samplesPerStep=4, groupSize=4)  # at most 8 unread documents: the replica holds often
    keys = keys_for("kill", spec)
    ensure_group(redis_client, keys.documents, protocol.DOCUMENTS_GROUP)
    for i in range(16):
        redis_client.xadd(keys.rollouts, make_group(f"g{i}", [0.0, 1.0, 0.5, 0.25], expected=4, version=i).encode())
    # An earlier run of replica 0 read two entries and died before writing them.
    ensure_group(redis_client, keys.rollouts, protocol.ROLLOUTS_GROUP)
    redis_client.xreadgroup(protocol.ROLLOUTS_GROUP, "preprocessor-0", {keys.rollouts: ">"}, count=2)
    first = start_role(roles, "preprocessor", tmp_path, "kill", spec, redis_server.url, RLKUBE_INDEX="0")
    read = [0]

    def read_at_least(n):
        read[0] += consume_n(redis_client, keys, 3)
        return read[0] >= n

    wait_for(lambda: read_at_least(24), START_TIMEOUT, "24 documents before the kill", first)
    assert "re-processing 2 rollout entries" in first.log()
    first.proc.send_signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    second = start_role(roles, "preprocessor", tmp_path, "kill", spec, redis_server.url, RLKUBE_INDEX="0")
    for i in range(16, 20):
        redis_client.xadd(keys.rollouts, make_group(f"g{i}", [0.0, 1.0, 0.5, 0.25], expected=4, version=i).encode())
    wait_for(lambda: (read_at_least(80), rollouts_done(redis_client, keys))[1], START_TIMEOUT,
             "every rollout acknowledged", second)
    assert documents_per_version(redis_client, keys) == {i: 4 for i in range(20)}
    assert read[0] + consume(redis_client, keys) == 80
    redis_client.xadd(keys.events, protocol.training_finished(step=5))
    assert second.wait(15) == 0
