"""Reads one job's trainer event stream from Redis with a blocking XREAD and wakes the job's reconcile loop.

One watcher per active job. It resumes after `status.trainer.lastEventId` (so an operator restart neither
loses nor double-counts events), buffers decoded events until a reconcile pass has recorded them in the
status, and reports reachability (EventSourceReachable) with the error that broke the connection.
The API server is never polled: Redis pushes entries to the blocked XREAD.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from rlkube.contract.protocol import TrainerEvent
from rlkube.contract.streams import AsyncEventReader
from rlkube.controller.reconcile import metrics
from rlkube.controller.decisions.observed import EventSource
from rlkube.controller.decisions.times import stream_id_key

log = logging.getLogger(__name__)

BLOCK_MS = 5000
"""XREAD block time. The socket timeout is longer, so a silent Redis shows up as a timeout error."""
RETRY_MAX = 5.0  # the longest wait between reconnect attempts
STOP_TIMEOUT = 2.0
CANCEL_AGAIN_S = 0.05
CATCH_UP_BATCH = 500


@dataclass(frozen=True)
class Target:
    """Where a job's events are: host/port/db of its Redis, the password, and the stream key."""

    url: str  # redis://host:port/db, without the password
    password: str | None
    stream: str

    def describe(self) -> str:
        return f"{self.url} stream {self.stream}"


class RedisClients:
    """One redis.asyncio client per Redis (URL and password), shared by the watchers of the jobs whose streams it
    holds (an external Redis serves many). Each blocked XREAD still takes a connection of its own from the client's
    pool; what is shared is the client itself (its command tables: about 18 KB per client) and its pool. The last
    watcher to let go closes it."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str | None], tuple[aioredis.Redis, int]] = {}

    def acquire(self, target: Target) -> aioredis.Redis:
        key = (target.url, target.password)
        client, users = self._clients.get(key) or (connect(target, BLOCK_MS / 1000 + 5), 0)
        self._clients[key] = (client, users + 1)
        return client

    async def release(self, target: Target) -> None:
        key = (target.url, target.password)
        client, users = self._clients[key]
        if users > 1:
            self._clients[key] = (client, users - 1)
            return
        del self._clients[key]
        with contextlib.suppress(Exception):
            await client.aclose()

    def __len__(self) -> int:
        return len(self._clients)


def connect(target: Target, socket_timeout: float) -> aioredis.Redis:
    return aioredis.Redis.from_url(target.url, password=target.password, socket_connect_timeout=3,
                                   socket_timeout=socket_timeout)


class EventWatcher:
    def __init__(self, target: Target, start_id: str | None, on_change: Callable[[], None],
                 clients: RedisClients | None = None):
        self.target = target
        self.on_change = on_change
        self.buffer: list[TrainerEvent] = []
        self.source = EventSource()
        self._clients = clients if clients is not None else RedisClients()
        self._client = self._clients.acquire(target)
        # No relocation: the position is the status's lastEventId, which decisions compare ids against; a new
        # Redis (a resumed job) comes with a new watcher started from a reset lastEventId.
        self.reader = AsyncEventReader(self._client, target.stream, start_id or "0-0", relocate=False,
                                       retry_on=(RedisError, OSError), backoff=(0.2, RETRY_MAX),
                                       on_state=self._on_state)
        self._task: asyncio.Task | None = None

    @property
    def last_id(self) -> str:
        """The last stream id read, malformed entries included (they are skipped, not re-read)."""
        return self.reader.last_id or "0-0"

    def start(self) -> EventWatcher:
        self._task = asyncio.create_task(self._run(), name=f"events {self.target.stream}")
        return self

    async def stop(self) -> None:
        """Cancel the reader. redis-py can turn a cancellation that lands inside connect() into a
        ConnectionError, so the reader also checks its stop event, and this never waits long for it."""
        self.reader.stop.set()
        if self._task is not None:
            # A cancellation that lands while redis-py is checking out a connection can be swallowed, and the XREAD
            # then blocks its whole BLOCK_MS: cancel again until the task is done.
            deadline = asyncio.get_running_loop().time() + STOP_TIMEOUT
            while not self._task.done() and (left := deadline - asyncio.get_running_loop().time()) > 0:
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=min(CANCEL_AGAIN_S, left))
            self._task = None
        if self._client is not None:
            self._client = None
            await self._clients.release(self.target)

    def pending(self, after: str | None) -> list[TrainerEvent]:
        """Buffered events after `after` (the id the status already holds)."""
        floor = stream_id_key(after)
        return [e for e in self.buffer if stream_id_key(e.stream_id) > floor]

    def commit(self, upto: str | None) -> None:
        """Forget events the status now records."""
        floor = stream_id_key(upto)
        self.buffer = [e for e in self.buffer if stream_id_key(e.stream_id) > floor]

    async def read_to_end(self) -> bool:
        """Read the stream to its end NOW, on a connection of its own, and buffer what it holds.

        The blocked XREAD of `_run` may deliver an entry late (a busy event loop, a reconnect, a lost push), so
        "the watcher has read to the end" is no proof that an entry published a moment ago is buffered. A pass
        that must know an event is really NOT in the stream (a producer's exit 0 without training_finished)
        calls this after it has looked at the pods: the read starts after those pods ended, so anything that
        made them stop is in the buffer when it returns True. False: Redis could not be read (judge nothing).
        The reader drops what the blocked XREAD then delivers again.
        """
        client = connect(self.target, 3)
        before = self.reader.last_id
        try:
            self._ingest(await self.reader.read_to_end(CATCH_UP_BATCH, client=client), before)
            return True
        except (RedisError, OSError) as exc:
            log.warning("trainer events: reading %s to its end failed: %s", self.target.describe(), exc)
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    def _on_state(self, reader: AsyncEventReader) -> None:
        describe = self.target.describe()
        if reader.error is not None:
            exc = reader.error
            source = EventSource("Unreachable", type(exc).__name__, f"{describe}: {exc}")
        else:
            source = EventSource("Reachable", "Connected", describe, caught_up=reader.caught_up)
        if (source.state, source.reason, source.caught_up) != (self.source.state, self.source.reason,
                                                               self.source.caught_up):
            self.source = source
            self.on_change()
        else:
            self.source = source

    async def _run(self) -> None:
        # Each poll first catches up without blocking after a (re)connect, so the reconcile loop soon knows what
        # is NOT in the stream; then it blocks in XREAD (Redis pushes new entries), reconnecting with back-off.
        while not self.reader.stop.is_set():
            before = self.reader.last_id
            self._ingest(await self.reader.poll(block_ms=BLOCK_MS, count=CATCH_UP_BATCH), before)

    def _ingest(self, events: list[TrainerEvent], before: str | None) -> None:
        """Buffer newly read events; wake the reconcile loop when the position moved (skipped malformed or
        unknown entries move it too: it is the read position the status records)."""
        now = time.time()
        for event in events:
            self.buffer.append(event)
            metrics.TRAINER_EVENT_LAG.observe(max(0.0, now - event.time))
        if self.reader.last_id != before:
            self.on_change()
