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

from rlkube.controller import metrics
from rlkube.controller.observed import EventSource
from rlkube.controller.times import stream_id_key
from rlkube.core.protocol import TrainerEvent, decode_event

log = logging.getLogger(__name__)

BLOCK_MS = 5000
"""XREAD block time. The socket timeout is longer, so a silent Redis shows up as a timeout error."""
RETRY_MAX = 5.0
STOP_TIMEOUT = 2.0
CATCH_UP_BATCH = 500


@dataclass(frozen=True)
class Target:
    """Where a job's events are: host/port/db of its Redis, the password, and the stream key."""

    url: str  # redis://host:port/db, without the password
    password: str | None
    stream: str

    def describe(self) -> str:
        return f"{self.url} stream {self.stream}"


class EventWatcher:
    def __init__(self, target: Target, start_id: str | None, on_change: Callable[[], None]):
        self.target = target
        self.last_id = start_id or "0-0"
        self.on_change = on_change
        self.buffer: list[TrainerEvent] = []
        self.source = EventSource()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self) -> EventWatcher:
        self._task = asyncio.create_task(self._run(), name=f"events {self.target.stream}")
        return self

    async def stop(self) -> None:
        """Cancel the reader. redis-py can turn a cancellation that lands inside connect() into a
        ConnectionError, so the loop also checks `_stopping`, and this never waits long for it."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=STOP_TIMEOUT)
            self._task = None

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
        """
        client = aioredis.Redis.from_url(
            self.target.url, password=self.target.password, socket_connect_timeout=3, socket_timeout=3
        )
        try:
            while True:
                reply = await client.xread({self.target.stream: self.last_id}, count=CATCH_UP_BATCH)
                if (self._ingest(reply) if reply else 0) < CATCH_UP_BATCH:
                    return True
        except (RedisError, OSError) as exc:
            log.warning("trainer events: reading %s to its end failed: %s", self.target.describe(), exc)
            return False
        finally:
            with contextlib.suppress(Exception):
                await client.aclose()

    def _set_source(self, source: EventSource) -> None:
        if (source.state, source.reason, source.caught_up) != (self.source.state, self.source.reason,
                                                               self.source.caught_up):
            self.source = source
            self.on_change()
        else:
            self.source = source

    async def _run(self) -> None:
        delay = 0.2
        while not self._stopping:
            client = aioredis.Redis.from_url(
                self.target.url,
                password=self.target.password,
                socket_connect_timeout=3,
                socket_timeout=BLOCK_MS / 1000 + 5,
            )
            try:
                await client.ping()
                self._set_source(EventSource("Reachable", "Connected", self.target.describe()))
                delay = 0.2
                # Catch up without blocking first, so the reconcile loop soon knows what is NOT in the stream.
                while True:
                    reply = await client.xread({self.target.stream: self.last_id}, count=CATCH_UP_BATCH)
                    read = self._ingest(reply) if reply else 0
                    if read < CATCH_UP_BATCH:
                        break
                self._set_source(EventSource("Reachable", "Connected", self.target.describe(), caught_up=True))
                while True:
                    reply = await client.xread({self.target.stream: self.last_id}, block=BLOCK_MS, count=500)
                    if reply:
                        self._ingest(reply)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                if self._stopping:
                    return
                message = f"{self.target.describe()}: {exc}"
                log.warning("trainer events unreachable: %s", message)
                self._set_source(EventSource("Unreachable", type(exc).__name__, message))
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()
            # A retry delay (capped backoff) before reconnecting, not a wait for a condition.
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    def _ingest(self, reply) -> int:
        """Buffer the entries of one XREAD reply; returns how many entries it held."""
        now = time.time()
        read = 0
        for _stream, entries in reply:
            read += len(entries)
            for sid, fields in entries:
                sid = sid.decode() if isinstance(sid, bytes) else str(sid)
                if stream_id_key(sid) <= stream_id_key(self.last_id):
                    continue  # already read by `read_to_end` while this XREAD was in flight
                self.last_id = sid
                event = decode_event(sid, fields)
                if event is None:
                    continue
                self.buffer.append(event)
                metrics.TRAINER_EVENT_LAG.observe(max(0.0, now - int(sid.split("-")[0]) / 1000))
        # Skipped (malformed or unknown) entries still advance `last_id`, the read position the status records.
        if read:
            self.on_change()
        return read
