"""The shared trainer-event readers and `ensure_group` (contract/streams.py) against real redis-servers: decoding and
skipping, overlap between connections, positioning at the newest state, reconnecting after a redis-server is
killed and restarted empty on the same port, and consumer groups surviving a lost stream."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
import redis
import redis.asyncio as aioredis
from rlkube.contract import protocol
from rlkube.contract.streams import AsyncEventReader, EventReader, ensure_group
from rlkube.local.redis_server import RedisServer

pytestmark = pytest.mark.timeout(90)

STREAM = protocol.StreamKeys.for_job("ns", "job").events
STATE = (protocol.WEIGHTS_READY, protocol.TRAINING_FINISHED)


def _sid(value) -> str:
    return protocol.text(value)


def _write_mixed(client: redis.Redis) -> dict[str, str]:
    """Good, malformed and unknown entries; returns the ids by name."""
    return {name: _sid(client.xadd(STREAM, fields)) for name, fields in [
        ("weights", protocol.weights_ready(1, 32, version=1)),
        ("no_field", {"other": b"x"}),
        ("not_json", {"event": b"{nope"}),
        ("no_type", {"event": b'{"step": 3}'}),
        ("metrics", protocol.encode_event(protocol.METRICS, step=1, loss=0.5)),
        ("unknown", {"event": b'{"type": "shiny_new_event"}'}),
    ]}


def _shape(events: list[protocol.TrainerEvent]) -> list[tuple[str, str, dict]]:
    return [(e.stream_id, e.type, e.payload) for e in events]


def _kill(server: RedisServer) -> None:
    """SIGKILL: no shutdown, the connections just break."""
    os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def test_malformed_and_unknown_entries_are_skipped_but_read_past_and_async_reads_the_same(redis_server,
                                                                                          redis_client):
    ids = _write_mixed(redis_client)
    reader = EventReader(redis_client, STREAM)
    events = reader.read_to_end(count=2)  # several batches
    assert [e.type for e in events] == [protocol.WEIGHTS_READY, protocol.METRICS]
    assert reader.last_id == ids["unknown"]  # the trailing unknown entry is behind us: never read again
    assert events[1].time == int(ids["metrics"].split("-")[0]) / 1000
    assert reader.read(block_ms=50) == []
    finished = _sid(redis_client.xadd(STREAM, protocol.training_finished(step=1)))
    assert [e.stream_id for e in reader.read()] == [finished]

    async def read_async():
        client = aioredis.Redis.from_url(redis_server.url)
        try:
            areader = AsyncEventReader(client, STREAM)
            got = await areader.read_to_end(count=2)
            return got, areader.last_id
        finally:
            await client.aclose()

    got, last = asyncio.run(read_async())
    assert _shape(got) == _shape(events) + _shape([protocol.TrainerEvent(finished, protocol.TRAINING_FINISHED,
                                                                        {"type": "training_finished", "step": 1})])
    assert last == finished
    # A reader resumed after an id (the operator's lastEventId) starts right after it.
    assert [e.stream_id for e in EventReader(redis_client, STREAM, ids["weights"]).read_to_end()] == [
        ids["metrics"], finished]


def test_overlapping_reads_on_two_connections_deliver_each_entry_once(redis_server, redis_client):
    reader = EventReader(redis_client, STREAM)
    first = _sid(redis_client.xadd(STREAM, protocol.weights_ready(1, 8)))
    second = _sid(redis_client.xadd(STREAM, protocol.weights_ready(2, 16)))
    other = redis_server.client()
    try:
        reader.last_id = "0-0"
        assert [e.stream_id for e in reader.read_to_end(client=other)] == [first, second]
        # A read that was issued from an older position (the watcher's blocked XREAD) brings nothing twice.
        reply = redis_client.xread({STREAM: "0-0"})
        assert reader._take(reply) == ([], 2)
        assert reader.last_id == second
    finally:
        other.close()


def test_a_reader_without_a_position_starts_at_the_newest_weights_or_finish(redis_client):
    assert EventReader(redis_client, STREAM, None, latest_of=STATE).read() == []  # no stream at all
    redis_client.xadd(STREAM, protocol.weights_ready(1, 8, version=1))
    newest = _sid(redis_client.xadd(STREAM, protocol.weights_ready(2, 16, version=2)))
    after = [_sid(redis_client.xadd(STREAM, protocol.encode_event(protocol.METRICS, step=i))) for i in range(100)]
    reader = EventReader(redis_client, STREAM, None, latest_of=STATE)
    events = reader.read_to_end()  # the newest weights_ready is 100 entries back: found over several pages
    assert [e.stream_id for e in events] == [newest, *after]
    assert events[0].payload["version"] == 2
    # Nothing of the kind: the reader starts at the stream's beginning.
    empty = protocol.StreamKeys.for_job("ns", "other").events
    metrics = _sid(redis_client.xadd(empty, protocol.encode_event(protocol.METRICS, step=1)))
    reader = EventReader(redis_client, empty, None, latest_of=STATE)
    assert reader.read() == [] and reader.last_id == "0-0"
    assert [e.stream_id for e in reader.read()] == [metrics]


def test_a_non_connection_error_is_not_retried(redis_client):
    redis_client.set(STREAM, "not a stream")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        EventReader(redis_client, STREAM).poll()


def _poll_until(reader: EventReader, predicate, tries: int = 40) -> list[protocol.TrainerEvent]:
    """Poll (each poll waits its back-off or blocks 200 ms) until `predicate(events read so far)`."""
    events: list[protocol.TrainerEvent] = []
    for _ in range(tries):
        events += reader.poll(block_ms=200)
        if predicate(events):
            return events
    raise AssertionError(f"condition not met after {tries} polls; read {_shape(events)}; error {reader.error!r}")


def test_sync_reader_reconnects_after_a_kill_and_rereads_a_stream_recreated_with_lower_ids(tmp_path):
    server = RedisServer(tmp_path / "r1").start()
    port = server.port
    client = server.client(socket_timeout=5)
    states: list[tuple[str | None, bool, bool]] = []
    try:
        client.xadd(STREAM, protocol.weights_ready(1, 8, version=1))
        reader = EventReader(client, STREAM, on_state=lambda r: states.append(
            (type(r.error).__name__ if r.error else None, r.connected, r.caught_up)))
        assert [e.payload["version"] for e in reader.poll(block_ms=200)] == [1]
        assert states == [(None, True, False), (None, True, True)]
        _kill(server)
        assert reader.poll(block_ms=200) == []
        assert isinstance(reader.error, redis.ConnectionError) and not reader.connected
        assert states[-1] == ("ConnectionError", False, False)
        failed_delay = reader.delay
        assert reader.poll(block_ms=200) == [] and reader.delay == min(2 * failed_delay, 2.0)  # backing off
        # The same port, empty, and a producer whose ids are below ours (a clock behind the old one's).
        server = RedisServer(tmp_path / "r2", port=port).start()
        writer = server.client()
        writer.xadd(STREAM, protocol.weights_ready(5, 40, version=5), id="1-1")
        writer.close()
        events = _poll_until(reader, lambda got: got)
        assert [(e.stream_id, e.payload["version"]) for e in events] == [("1-1", 5)]
        assert reader.error is None and states[-1] == (None, True, True)
    finally:
        client.close()
        server.stop()


def test_async_reader_reconnects_and_follows_from_the_newest_state_after_a_restart(tmp_path):
    server = RedisServer(tmp_path / "r1").start()
    port = server.port
    holder = {"server": server}

    async def scenario():
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=5)
        stop = asyncio.Event()
        reader = AsyncEventReader(client, STREAM, None, latest_of=STATE, stop=stop, backoff=(0.1, 0.5))
        seen: list[protocol.TrainerEvent] = []
        arrived = asyncio.Event()

        async def follow():
            async for event in reader.follow(block_ms=200):
                seen.append(event)
                arrived.set()

        async def until(n: int):
            while len(seen) < n:
                await arrived.wait()
                arrived.clear()

        await client.xadd(STREAM, protocol.weights_ready(1, 8, version=1))
        await client.xadd(STREAM, protocol.weights_ready(2, 16, version=2))
        task = asyncio.create_task(follow())
        try:
            await asyncio.wait_for(until(1), 20)
            assert [e.payload["version"] for e in seen] == [2]  # only the newest state
            await asyncio.to_thread(_kill, holder["server"])
            holder["server"] = await asyncio.to_thread(RedisServer(tmp_path / "r2", port=port).start)
            writer = holder["server"].client()
            writer.xadd(STREAM, protocol.weights_ready(3, 24, version=3), id="1-1")
            writer.xadd(STREAM, protocol.weights_ready(4, 32, version=4), id="1-2")
            writer.close()
            await asyncio.wait_for(until(2), 30)
            # Re-located at the newest state of the new stream, not at its start, and nothing twice.
            assert [e.payload["version"] for e in seen] == [2, 4]
            assert reader.error is None and reader.caught_up
            stop.set()
            await asyncio.wait_for(task, 5)  # `follow` ends on stop
        finally:
            task.cancel()
            await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        holder["server"].stop()


def test_stop_cuts_the_back_off_short(tmp_path):
    server = RedisServer(tmp_path / "r").start()
    client = server.client(socket_timeout=2)
    _kill(server)
    stop = threading.Event()
    reader = EventReader(client, STREAM, stop=stop, backoff=(30.0, 30.0))
    try:
        assert reader.poll() == [] and reader.delay == 30.0
        done = threading.Event()
        thread = threading.Thread(target=lambda: (reader.poll(), done.set()))
        thread.start()
        stop.set()
        assert done.wait(5), "poll kept waiting its 30 s back-off after stop"
        thread.join()
        assert list(reader.follow(block_ms=100)) == []
    finally:
        client.close()


def test_ensure_group_is_idempotent_and_recreates_a_lost_group(redis_client):
    stream, group = "docs", "readers"
    ensure_group(redis_client, stream, group)
    ensure_group(redis_client, stream, group)  # BUSYGROUP: fine
    first = _sid(redis_client.xadd(stream, {"n": "1"}))
    got = redis_client.xreadgroup(group, "c", {stream: ">"}, count=10)
    assert [_sid(i) for i, _ in got[0][1]] == [first]
    ensure_group(redis_client, stream, group)  # an existing group keeps its position
    assert redis_client.xreadgroup(group, "c", {stream: ">"}, count=10) == []

    for lose in (lambda: redis_client.delete(stream), lambda: redis_client.xgroup_destroy(stream, group)):
        redis_client.xadd(stream, {"n": "x"})
        lose()
        with pytest.raises(redis.ResponseError) as err:
            redis_client.xreadgroup(group, "c", {stream: ">"}, count=10)
        assert protocol.group_lost(err.value)
        ensure_group(redis_client, stream, group)
        entry = _sid(redis_client.xadd(stream, {"n": "2"}))
        got = redis_client.xreadgroup(group, "c", {stream: ">"}, count=10)
        assert entry in [_sid(i) for i, _ in got[0][1]]

    # A start id: the group reads only what comes after it.
    redis_client.xadd("fresh", {"n": "old"})
    ensure_group(redis_client, "fresh", group, "$")
    new = _sid(redis_client.xadd("fresh", {"n": "new"}))
    assert [_sid(i) for i, _ in redis_client.xreadgroup(group, "c", {"fresh": ">"})[0][1]] == [new]
