"""One tracker sink on a background thread behind a bounded queue.

Why: a tracker's client blocks on its server (connect timeouts, retries, a refused key), and training must never
wait for it. The trainer only enqueues (never blocks: a full queue drops the item and counts it); the worker opens
the sink, then calls it item by item. The sink's first exception ends it for this process: it is reported once
through `on_failure` and nothing more is sent to it, while the other sinks go on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from rlkube.core.tracking.run import RunState

log = logging.getLogger("rlkube.tracking")

QUEUE_CAPACITY = 10_000
"""Items a sink may fall behind by before new ones are dropped (a step's metrics are one item)."""


class Sink(Protocol):
    """What a tracker implements; every method runs on the sink's worker thread, `open` first."""

    name: str

    def open(self) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None: ...

    def close(self, finished: bool) -> None: ...


class SinkWorker:
    def __init__(self, sink: Sink, on_failure: Callable[[str, BaseException], None], run: RunState | None = None,
                 capacity: int = QUEUE_CAPACITY):
        self.sink = sink
        self.run = run
        self.on_failure = on_failure
        self.queue: queue.Queue[tuple[str, tuple[Any, ...]] | None] = queue.Queue(capacity)
        self.failed = False
        self.dropped = 0
        self.thread = threading.Thread(target=self._run, name=f"tracker-{sink.name}", daemon=True)
        self.thread.start()

    @property
    def name(self) -> str:
        return self.sink.name

    def submit(self, method: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            self.queue.put_nowait((method, args))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracking: %s is behind by %d items; dropping new ones", self.name, self.queue.maxsize)

    def close(self, finished: bool, timeout_s: float) -> bool:
        """Ask the worker to flush and close the sink; wait up to `timeout_s` in all (a stuck sink's full queue
        included, so that its failure is reported before the trainer's last report). True when it ended in time."""
        deadline = time.monotonic() + timeout_s
        if self.thread.is_alive() and not self.failed:
            try:
                self.queue.put(("close", (finished,)), timeout=timeout_s)
                self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            # Still connecting or sending (an unreachable server retries for its client's timeout): reported as the
            # tracker's failure, since what is queued will not reach it; the thread is left behind (a daemon).
            if not self.failed:
                self.failed = True
                self.on_failure(self.name, TimeoutError(f"not done {timeout_s:g}s after the training ended "
                                                        "(unreachable?); what was still queued is lost"))
            return False
        return True

    def _run(self) -> None:
        try:
            self.sink.open()
            while (item := self.queue.get()) is not None:
                method, args = item
                if method == "log_metrics" and self.run is not None:
                    self._log_metrics(*args)
                else:
                    getattr(self.sink, method)(*args)
        except BaseException as exc:  # noqa: BLE001 - any failure of a tracker ends that tracker, never training
            self.failed = True
            self.on_failure(self.name, exc)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Only what this tracker's run lacks (a restarted trainer re-trains the steps after its checkpoint)."""
        assert self.run is not None
        fresh = self.run.unlogged(self.name, metrics, step)
        if fresh:
            self.sink.log_metrics(fresh, step)
            self.run.mark(self.name, fresh, step)
