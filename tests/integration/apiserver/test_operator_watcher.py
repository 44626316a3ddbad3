"""The operator's Redis event watcher against a real redis-server: blocking read, resume, skips, reachability."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from rlkube.controller.reconcile.watcher import EventWatcher, RedisClients, Target
from rlkube.contract import protocol
from rlkube.local.redis_server import RedisServer

pytestmark = pytest.mark.timeout(60)


async def _until(predicate, wake: asyncio.Event, timeout: float = 10) -> None:
    async def loop():
        while not predicate():
            await wake.wait()
            wake.clear()
    await asyncio.wait_for(loop(), timeout)


async def test_reads_events_as_they_arrive_skips_malformed_ones_and_resumes_after_an_id(tmp_path):
    with RedisServer(tmp_path / "r", password="pw") as server:
        keys = protocol.StreamKeys.for_job("ns", "job")
        writer = aioredis.Redis.from_url(server.url)
        first = (await writer.xadd(keys.events, protocol.weights_ready(1, 32))).decode()
        wake = asyncio.Event()
        url = f"redis://{server.host}:{server.port}/0"
        watcher = EventWatcher(Target(url, "pw", keys.events), None, wake.set).start()
        try:
            await _until(lambda: len(watcher.buffer) == 1, wake)
            assert watcher.source.state == "Reachable"
            await writer.xadd(keys.events, {"event": b"not json"})  # malformed: skipped, position advances
            await writer.xadd(keys.events, {"event": b'{"type": "shiny_new_event"}'})  # unknown type: ignored
            last = (await writer.xadd(keys.events, protocol.training_finished(step=1, checkpoint="/c"))).decode()
            await _until(lambda: watcher.last_id == last, wake)
            assert [e.type for e in watcher.pending(None)] == ["weights_ready", "training_finished"]
            assert [e.stream_id for e in watcher.pending(first)] == [last]
            watcher.commit(first)
            assert [e.stream_id for e in watcher.buffer] == [last]
        finally:
            await watcher.stop()
        # A new watcher (an operator restart) resumes after the id the status recorded.
        resumed = EventWatcher(Target(url, "pw", keys.events), first, wake.set).start()
        try:
            await _until(lambda: resumed.last_id == last, wake)
            assert [e.stream_id for e in resumed.buffer] == [last]
        finally:
            await resumed.stop()
            await writer.aclose()


async def test_reports_unreachable_with_the_reason_then_reconnects(tmp_path):
    server = RedisServer(tmp_path / "r", password="pw", host="127.0.0.1").start()
    port = server.port
    url = f"redis://127.0.0.1:{port}/0"
    wake = asyncio.Event()
    keys = protocol.StreamKeys.for_job("ns", "job")
    wrong = EventWatcher(Target(url, "wrong", keys.events), None, wake.set).start()
    watcher = EventWatcher(Target(url, "pw", keys.events), None, wake.set).start()
    try:
        await _until(lambda: wrong.source.state == "Unreachable", wake)
        assert wrong.source.reason == "AuthenticationError"
        await _until(lambda: watcher.source.state == "Reachable", wake)
        server.stop()
        await _until(lambda: watcher.source.state == "Unreachable", wake, timeout=20)
        assert watcher.source.reason == "ConnectionError" and str(port) in watcher.source.message
        server = RedisServer(tmp_path / "r2", password="pw", host="127.0.0.1", port=port).start()
        await _until(lambda: watcher.source.state == "Reachable", wake, timeout=20)
    finally:
        await wrong.stop()
        await watcher.stop()
        server.stop()


async def test_a_watcher_retired_by_a_pass_stops_in_the_background_and_stop_watcher_waits_for_it(tmp_path):
    from rlkube.controller.reconcile.loop import JobLoop, Shared

    with RedisServer(tmp_path / "r", password="pw") as server:
        keys = protocol.StreamKeys.for_job("ns", "job")
        loop = JobLoop(Shared(kube=None), "ns", "job")
        old = EventWatcher(Target(f"redis://{server.host}:{server.port}/0", "pw", keys.events), None,
                           lambda: None).start()
        loop.watcher = old
        release = asyncio.Event()
        real_stop = old.stop

        async def held_stop():  # a stop that hangs as a cancelled XREAD can (up to watcher.STOP_TIMEOUT)
            await release.wait()
            await real_stop()

        old.stop = held_stop
        loop._retire_watcher()  # what a pass does when the target changes: it must not wait for the stop
        assert loop.watcher is None
        assert old._task is not None and not old._task.done()
        stopping = asyncio.create_task(loop.stop_watcher())
        await asyncio.wait({stopping}, timeout=0.2)
        assert not stopping.done(), "stop_watcher returned while a retired watcher was still running"
        release.set()
        await asyncio.wait_for(stopping, 10)
        assert old._task is None and not loop._retiring


async def test_jobs_on_one_redis_share_its_client_each_reading_its_own_stream(tmp_path):
    with RedisServer(tmp_path / "r", password="pw") as server:
        url = f"redis://{server.host}:{server.port}/0"
        writer = aioredis.Redis.from_url(server.url)
        clients = RedisClients()
        wake = asyncio.Event()
        a, b = (protocol.StreamKeys.for_job("ns", job).events for job in ("a", "b"))
        watch_a = EventWatcher(Target(url, "pw", a), None, wake.set, clients).start()
        watch_b = EventWatcher(Target(url, "pw", b), None, wake.set, clients).start()
        other = EventWatcher(Target(url, "wrong", a), None, wake.set, clients).start()  # not the same client
        try:
            assert len(clients) == 2 and watch_a.reader.client is watch_b.reader.client
            assert other.reader.client is not watch_a.reader.client
            # Both blocked XREADs are served at once (a connection each from the shared pool).
            id_a = (await writer.xadd(a, protocol.weights_ready(1, 32))).decode()
            id_b = (await writer.xadd(b, protocol.weights_ready(2, 64))).decode()
            await _until(lambda: watch_a.last_id == id_a and watch_b.last_id == id_b, wake)
            assert [e.stream_id for e in watch_a.buffer] == [id_a] and [e.stream_id for e in watch_b.buffer] == [id_b]
            await other.stop()
            await watch_a.stop()  # the client stays open for b
            assert len(clients) == 1
            id_b2 = (await writer.xadd(b, protocol.weights_ready(3, 96))).decode()
            await _until(lambda: watch_b.last_id == id_b2, wake)
        finally:
            for w in (other, watch_a, watch_b):
                await w.stop()
            await writer.aclose()
        assert len(clients) == 0
