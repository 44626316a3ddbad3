"""Redis stream I/O shared by every role and the operator: the trainer-event readers and consumer-group creation.

protocol.py says what the entries mean; this module owns how they are read, once, so the operator's watcher,
the actor, the inference follower, the preprocessor and `rlkube local` cannot drift apart on it:
- `EventReader` (redis-py) and `AsyncEventReader` (redis.asyncio) read a job's events stream from a position
  (`last_id`), decode each entry with protocol.decode_event, skip malformed and unknown entries but advance past
  them (so a caller that persists `last_id`, as the operator does in status.trainer.lastEventId, never
  re-reads them), and drop entries at or before `last_id` (two reads on two connections may overlap).
- `poll()` / `follow()` add the connection handling: a connection error is reported (`error`, `on_state`)
  and the next attempt waits a bounded, doubling back-off (cut short by `stop`); after it reconnects, the
  reader checks whether the stream is still the one it was reading (a Redis that restarted empty starts its
  ids anew, possibly below ours: a new pod on a node whose clock is behind) and starts over if not.
- `latest_of`: a reader without a start position begins at the newest event of these types already in the
  stream (the actor and inference only need the current weights and whether training finished, not history).
- `ensure_group`: XGROUP CREATE ... MKSTREAM, idempotent; callers run it at start and again after a read
  failed with NOGROUP (protocol.group_lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlkube.contract.protocol import TrainerEvent, decode_event, stream_id_key, text

log = logging.getLogger(__name__)

RETRIABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError)
"""Errors after which `poll` reconnects; any other error propagates."""
BACKOFF = (0.2, 2.0)
"""First and largest wait before a reconnect attempt, in seconds (doubling in between)."""
LOCATE_BATCH = 64


def ensure_group(client: redis.Redis, stream: str, group: str, start_id: str = "0") -> None:
    """Consumer group `group` on `stream` (created empty if absent), reading from after `start_id`. An existing
    group keeps its position (a restarted consumer goes on where the group was)."""
    try:
        client.xgroup_create(stream, group, id=start_id, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class _Position:
    """What both readers share: the position in the stream, the connection state and the decoding (no I/O)."""

    def __init__(self, stream: str, start: str | None, latest_of: tuple[str, ...], relocate: bool,
                 retry_on: tuple[type[BaseException], ...], backoff: tuple[float, float],
                 on_state: Callable[[Any], None] | None):
        self.stream = stream
        self.last_id: str | None = start
        """The last entry read (malformed ones included); None: not positioned yet (see `latest_of`)."""
        self.latest_of = latest_of
        self.relocate = relocate
        self.retry_on = retry_on
        self.backoff = backoff
        self.on_state = on_state
        self.error: BaseException | None = None
        """The error of the last failed attempt; None once a connection succeeded."""
        self.connected = False
        self.caught_up = False
        """The reader has read the stream to its end since it (re)connected."""
        self.delay: float | None = None  # wait before the next attempt; None: the last one did not fail

    def _take(self, reply: Any) -> tuple[list[TrainerEvent], int]:
        """Decoded events of one XREAD reply after `last_id`, and how many entries the reply held."""
        events: list[TrainerEvent] = []
        entries = 0
        for _stream, items in reply or []:
            entries += len(items)
            for sid, fields in items:
                sid = text(sid)
                if stream_id_key(sid) <= stream_id_key(self.last_id):
                    continue  # already read (another read on another connection overlapped this one)
                self.last_id = sid  # malformed entries too: they are skipped, never re-read
                event = decode_event(sid, fields)
                if event is not None:
                    events.append(event)
        return events, entries

    def _located(self, entries: Any) -> tuple[TrainerEvent | None, str | None]:
        """The newest `latest_of` event in one XREVRANGE page, or where the next page starts (None: no more)."""
        for sid, fields in entries:
            event = decode_event(sid, fields)
            if event is not None and event.type in self.latest_of:
                self.last_id = event.stream_id
                return event, None
        if len(entries) < LOCATE_BATCH:
            self.last_id = "0-0"
            return None, None
        return None, "(" + text(entries[-1][0])

    def _gone(self, info: dict | None) -> bool:
        """After a reconnect: whether the stream is not the one we read (absent, or its ids are below ours)."""
        if self.last_id is None or stream_id_key(self.last_id) == (0, 0):
            return False
        top = None if info is None else text(info.get("last-generated-id", info.get(b"last-generated-id")))
        if top is not None and stream_id_key(top) >= stream_id_key(self.last_id):
            return False
        log.warning("events stream %s was recreated (newest id %s, ours %s): reading it from the %s", self.stream,
                    top, self.last_id, "newest trainer state" if self.latest_of else "start")
        self.last_id = None if self.latest_of else "0-0"
        return True

    def _failed(self, exc: BaseException) -> None:
        self.delay = self.backoff[0] if self.delay is None else min(2 * self.delay, self.backoff[1])
        log.warning("events stream %s unreachable (%s: %s); retrying in %.1fs", self.stream, type(exc).__name__,
                    exc, self.delay)
        self._set(error=exc, connected=False, caught_up=False)

    def _set(self, **state: Any) -> None:
        changed = any(getattr(self, k) is not v for k, v in state.items())
        for k, v in state.items():
            setattr(self, k, v)
        if changed and self.on_state is not None:
            self.on_state(self)


class EventReader(_Position):
    """A job's trainer events, read with redis-py (blocking calls; for threads and plain loops).

    `start`: the id to read after ("0-0": the whole stream); None with `latest_of`: the newest such event.
    `relocate`: start over when the stream was recreated (see the module doc); a reader whose position is
    persisted elsewhere and compared there (the operator's) passes False.
    `stop`: set -> `follow` ends and a back-off wait is cut short.
    """

    def __init__(self, client: redis.Redis, stream: str, start: str | None = "0-0", *,
                 latest_of: tuple[str, ...] = (), relocate: bool = True,
                 retry_on: tuple[type[BaseException], ...] = RETRIABLE, backoff: tuple[float, float] = BACKOFF,
                 stop: threading.Event | None = None, on_state: Callable[[EventReader], None] | None = None):
        super().__init__(stream, start, latest_of, relocate, retry_on, backoff, on_state)
        self.client = client
        self.stop = stop or threading.Event()

    def read(self, block_ms: int | None = None, count: int = 100) -> list[TrainerEvent]:
        """One XREAD after `last_id` (blocking up to `block_ms` when given). Redis errors propagate."""
        if self.last_id is None:
            return self._locate()
        reply = self.client.xread({self.stream: self.last_id}, count=count, block=block_ms)
        return self._take(reply)[0]

    def read_to_end(self, count: int = 500, client: redis.Redis | None = None) -> list[TrainerEvent]:
        """Everything after `last_id` up to the stream's end now, without blocking (on `client` if given: a
        connection of its own). Redis errors propagate."""
        client = client or self.client
        events = self._locate(client) if self.last_id is None else []
        while True:
            got, entries = self._take(client.xread({self.stream: self.last_id}, count=count))
            events += got
            if entries < count:
                return events

    def poll(self, block_ms: int | None = None, count: int = 100) -> list[TrainerEvent]:
        """`read` that survives connection errors: after one (reported in `error`) it returns [], and the next
        call waits the back-off, reconnects, re-checks the stream and reads it to its end first."""
        if self.delay is not None and self.stop.wait(self.delay):
            return []
        try:
            if not self.connected:
                self.client.ping()
                if self.error is not None and self.relocate:
                    self._gone(self._info())
                self.delay = None
                self._set(error=None, connected=True, caught_up=False)
                events = self.read_to_end(count)
                self._set(caught_up=True)
                return events
            return self.read(block_ms, count)
        except self.retry_on as exc:
            if not self.stop.is_set():
                self._failed(exc)
            return []

    def follow(self, block_ms: int, count: int = 100) -> Iterator[TrainerEvent]:
        """Every event from the position on, until `stop` is set; reconnects as `poll` does."""
        while not self.stop.is_set():
            yield from self.poll(block_ms, count)

    def _locate(self, client: redis.Redis | None = None) -> list[TrainerEvent]:
        client, newest = client or self.client, "+"
        while newest is not None:
            event, newest = self._located(client.xrevrange(self.stream, max=newest, count=LOCATE_BATCH))
            if event is not None:
                return [event]
        return []

    def _info(self) -> dict | None:
        try:
            return self.client.xinfo_stream(self.stream)
        except ResponseError:  # no such key
            return None


class AsyncEventReader(_Position):
    """`EventReader` for redis.asyncio clients (the operator's watcher, the actor); the same arguments, with an
    asyncio.Event as `stop`."""

    def __init__(self, client: aioredis.Redis, stream: str, start: str | None = "0-0", *,
                 latest_of: tuple[str, ...] = (), relocate: bool = True,
                 retry_on: tuple[type[BaseException], ...] = RETRIABLE, backoff: tuple[float, float] = BACKOFF,
                 stop: asyncio.Event | None = None, on_state: Callable[[AsyncEventReader], None] | None = None):
        super().__init__(stream, start, latest_of, relocate, retry_on, backoff, on_state)
        self.client = client
        self.stop = stop or asyncio.Event()

    async def read(self, block_ms: int | None = None, count: int = 100) -> list[TrainerEvent]:
        if self.last_id is None:
            return await self._locate()
        reply = await self.client.xread({self.stream: self.last_id}, count=count, block=block_ms)
        return self._take(reply)[0]

    async def read_to_end(self, count: int = 500, client: aioredis.Redis | None = None) -> list[TrainerEvent]:
        client = client or self.client
        events = await self._locate(client) if self.last_id is None else []
        while True:
            got, entries = self._take(await client.xread({self.stream: self.last_id}, count=count))
            events += got
            if entries < count:
                return events

    async def poll(self, block_ms: int | None = None, count: int = 100) -> list[TrainerEvent]:
        if self.delay is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), timeout=self.delay)
            if self.stop.is_set():
                return []
        try:
            if not self.connected:
                await self.client.ping()
                if self.error is not None and self.relocate:
                    self._gone(await self._info())
                self.delay = None
                self._set(error=None, connected=True, caught_up=False)
                events = await self.read_to_end(count)
                self._set(caught_up=True)
                return events
            return await self.read(block_ms, count)
        except self.retry_on as exc:
            # redis-py can turn a cancellation that lands inside connect() into a ConnectionError: stopping.
            if not self.stop.is_set():
                self._failed(exc)
            return []

    async def follow(self, block_ms: int, count: int = 100) -> AsyncIterator[TrainerEvent]:
        while not self.stop.is_set():
            for event in await self.poll(block_ms, count):
                yield event

    async def _locate(self, client: aioredis.Redis | None = None) -> list[TrainerEvent]:
        client, newest = client or self.client, "+"
        while newest is not None:
            event, newest = self._located(await client.xrevrange(self.stream, max=newest, count=LOCATE_BATCH))
            if event is not None:
                return [event]
        return []

    async def _info(self) -> dict | None:
        try:
            return await self.client.xinfo_stream(self.stream)
        except ResponseError:
            return None
