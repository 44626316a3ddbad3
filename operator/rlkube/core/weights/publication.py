"""The trainer's weight publication policy (docs/design.md §5.6), `WeightPublisher`: when and what to publish.
`weights_ready` is announced on the events stream BEFORE each transfer, with the version it carries; a failed
transfer or a server's rejoin request gets a new epoch, a lost announcement is announced again, an overlapped
transfer is waited for before the next. The transfer itself is rlkube.core.weights.group's, in
rlkube.core.weights.wire's format.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
import torch

from rlkube.contract import protocol
from rlkube.core.weights.group import WeightSender, WeightSyncError
from rlkube.core.weights.wire import DEFAULT_BUCKET_BYTES, PackedWeights, StreamedWeights

log = logging.getLogger(__name__)


class WeightPublisher:
    """The trainer's whole weight-publication duty: announce on the events stream, then transfer.

    `publish`/`start` also take a StreamedWeights (a sharded trainer, every rank calling its side): sent bucket by
    bucket as the ranks gather it, synchronously, with no snapshot kept (see `_publish_streamed`).

    ```
    pub = WeightPublisher(redis_client, ctx.keys, ctx.weight_sync_addr, ctx.weight_sync_world_size,
                          transfer_dtype=torch.bfloat16, bucket_bytes=64 * 2**20)
    pub.start(backend.weights(), version=resumed_step)            # at start-up (also after a restart)
    pub.publish(backend.weights(), version=step, step=step, documents_seen=n)  # after each optim_step
    pub.close()                                                   # on training_finished
    ```
    `start` opens a new epoch and pushes the current weights (version 0, or the resumed checkpoint's step): the
    inference servers join on that announcement and report healthy only then, so the trainer must call it before
    it waits for documents (the actors wait for inference health). It blocks until every server joined.

    With `overlap=True`, `publish` announces, snapshots the weights and returns while the transfer runs in a
    background thread, so the trainer's next step overlaps it; the next `publish` (and `close`) first waits for
    that transfer and raises its error, if any. The announcement stays synchronous, so events keep their order.

    A failed transfer (an inference server died) reopens a new epoch, announces it and sends again, up to
    `retries` times. A restarted inference server that missed the epoch asks for a new one through the store; a
    watchdog thread then re-announces and re-sends the last published weights (kept as a snapshot, detached
    clones) without waiting for the trainer's next step, which may never come while no rollouts are produced.
    The same watchdog re-announces a transfer whose announcement vanished from the stream while the transfer
    waits (a managed Redis restarted empty): the servers would otherwise never join it, and the trainer would sit
    in the broadcast until gloo's timeout (300 s).
    """

    # The capabilities the trainer reads (rlkube.core.trainer.publishers.Publisher declares them), declared here
    # rather than set per instance.
    streams = True
    """`start`/`publish` take a StreamedWeights (the sharded trainer passes one instead of named tensors) and run
    its passes (`_publish_streamed`)."""
    rejoin_pending = False
    """Streamed updates: an inference server asked to rejoin and the trainer must publish again (its ranks gather
    the weights anew); set by the watchdog, cleared by the next publish, which opens a new epoch."""

    def __init__(self, redis_client, keys: protocol.StreamKeys, addr: str, world_size: int,
                 timeout_s: float = 300, backend: str = "gloo", device: str = "cpu", retries: int = 3,
                 watch_interval_s: float = 0.5, local_host: str | None = None, overlap: bool = False,
                 transfer_dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.redis = redis_client
        self.keys = keys
        self.rejoin_pending = False
        self.sender = WeightSender(addr, world_size, timeout_s=timeout_s, backend=backend, device=device,
                                   local_host=local_host, transfer_dtype=transfer_dtype, bucket_bytes=bucket_bytes)
        self.retries = retries
        self.watch_interval_s = watch_interval_s
        self.epoch: str | None = None
        self.last_transfer_s = 0.0
        self._lock = threading.Lock()
        self._last: tuple[PackedWeights, int, int, int, dict[str, Any]] | None = None
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.overlap = overlap
        self._inflight: threading.Thread | None = None
        self._inflight_error: BaseException | None = None
        # The announcement of the transfer now running (stream id, fields), else None; read by the watchdog.
        self._announced: tuple[str, dict[str, Any]] | None = None

    def start(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0, step: int | None = None,
              documents_seen: int = 0, **extra: Any) -> None:
        """Open a fresh epoch and push the current weights (blocks until every inference server joined)."""
        with self._lock:
            self.epoch = self.sender.open()
        if self._watchdog is None:  # before the first transfer: its announcement may be lost too
            self._watchdog = threading.Thread(target=self._watch, name="weight-rejoin-watchdog", daemon=True)
            self._watchdog.start()
        self.publish(named_tensors, version, step=version if step is None else step,
                     documents_seen=documents_seen, **extra)
        self.wait()  # start-up stays blocking: the group must exist before the trainer waits for documents

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, step: int,
                documents_seen: int = 0, **extra: Any) -> None:
        """Announce `weights_ready` (with `epoch` and `version`), then transfer; reopen and retry on failure.

        Returns once every inference server has the weights (or, with overlap, once the transfer started from
        a snapshot); either way the caller may change the weights afterwards.
        """
        self.wait()
        if isinstance(named_tensors, StreamedWeights):
            return self._publish_streamed(named_tensors, version, step, documents_seen, extra)
        snapshot = self.sender.pack(named_tensors)  # a copy in the transfer dtype: the caller may go on training
        with self._lock:
            if self.epoch is None:
                raise RuntimeError("WeightPublisher.publish() before start()")
            self._last = (snapshot, int(version), int(step), int(documents_seen), extra)
            if not self.overlap:
                self._send_locked()
                return
            self._announce()
        self._inflight = threading.Thread(target=self._transfer_in_background, name="weight-transfer", daemon=True)
        self._inflight.start()

    def _publish_streamed(self, weights: StreamedWeights, version: int, step: int, documents_seen: int,
                          extra: dict[str, Any]) -> None:
        """A sharded trainer's update (every trainer rank gathers, this one sends): synchronous, and kept by no
        snapshot, so the watchdog can re-announce a lost announcement but cannot re-send to a rejoining server;
        the next publish opens a new epoch for it instead."""
        try:
            with self._lock:
                if self.epoch is None:
                    raise RuntimeError("WeightPublisher.publish() before start()")
                if self.rejoin_pending or (self.sender.epoch is not None and self.sender.rejoin_requested()):
                    self.epoch = self.sender.open()  # a new epoch the rejoining server can join
                self.rejoin_pending = False
                self._last = None

                def announce() -> None:
                    self._announce_fields(step, documents_seen, version, weights.meta["checksum"], extra)
                    weights.more(True)  # one more pass: the other trainer ranks gather for it

                self._send_with_retries(weights, version, announce)
        finally:
            weights.more(False)  # no further pass: the other trainer ranks leave drain()

    def wait(self) -> None:
        """Wait for an overlapped transfer; raise its error, if it failed."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        if self._inflight_error is not None:
            error, self._inflight_error = self._inflight_error, None
            raise error

    def _transfer_in_background(self) -> None:
        try:
            with self._lock:
                self._send_locked(announced=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's next publish()/close()
            self._inflight_error = exc

    def _announce_fields(self, step: int, documents_seen: int, version: int, checksum: float,
                         extra: dict[str, Any]) -> None:
        if self.sender.epoch is None:  # the last transfer broke the group: announce a new epoch
            self.epoch = self.sender.open()
        # The transport rides along (rlkube.contract.weight_transport): what the servers find in the store at join.
        fields = protocol.weights_ready(step, documents_seen, epoch=self.epoch, version=int(version),
                                        checksum=checksum, transport=self.sender.backend, **extra)
        self._announced = (protocol.text(self.redis.xadd(self.keys.events, fields)), fields)

    def _announce(self) -> None:
        packed, version, step, documents_seen, extra = self._last
        self._announce_fields(step, documents_seen, version, packed.meta["checksum"], extra)

    def _send_locked(self, announced: bool = False) -> None:
        tensors, version, *_ = self._last
        self._send_with_retries(tensors, version, self._announce, announced)

    def _send_with_retries(self, weights: PackedWeights | StreamedWeights, version: int,
                           announce: Callable[[], None], announced: bool = False) -> None:
        """Send `weights`, announcing first (unless `announced`) and again in a new epoch before each retry."""
        for attempt in range(self.retries + 1):
            if not announced or attempt > 0:
                announce()
            t0 = time.monotonic()
            try:
                self.sender.send(weights, version)
                self.last_transfer_s = time.monotonic() - t0
                return
            except WeightSyncError as exc:
                if attempt == self.retries:
                    raise
                log.warning("weight transfer of version %d failed (%s); opening a new epoch", version, exc)
            finally:
                self._announced = None

    def _watch(self) -> None:
        while not self._stop.wait(self.watch_interval_s):
            if not self._lock.acquire(blocking=False):
                self._reannounce_if_lost()  # a transfer is running; it will notice a dead peer itself
                continue
            try:
                if self.epoch is None or not self.sender.rejoin_requested():
                    continue
                if self._last is None:  # streamed (or nothing published yet): no snapshot to send from here
                    if not self.rejoin_pending:
                        log.warning("an inference server asked to rejoin epoch %s; the trainer must send the "
                                    "weights again (streamed: no snapshot here)", self.epoch)
                    self.rejoin_pending = True
                    continue
                log.warning("an inference server asked to rejoin epoch %s; re-announcing version %d in a new one",
                            self.epoch, self._last[1])
                self.epoch = self.sender.open()
                self._send_locked()
            except Exception as exc:  # noqa: BLE001 - the next publish() retries and raises if it stays broken
                log.error("re-sending weights for a rejoining inference server failed: %s", exc)
            finally:
                self._lock.release()

    def _reannounce_if_lost(self) -> None:
        announced = self._announced
        if announced is None:
            return
        sid, fields = announced
        try:
            if self.redis.xrange(self.keys.events, min=sid, max=sid):
                return
            if self._announced is not announced:
                return  # that transfer ended meanwhile
            new_id = protocol.text(self.redis.xadd(self.keys.events, fields))
        except redis.RedisError as exc:
            log.debug("cannot check the weights_ready announcement %s: %s", sid, exc)
            return
        self._announced = (new_id, fields)
        log.warning("the announcement %s of the running transfer is gone from the events stream (Redis restarted "
                    "empty?): announced it again as %s", sid, new_id)

    def close(self) -> None:
        """Finish an overlapped transfer, stop the watchdog and leave the group (before training_finished)."""
        try:
            self.wait()
        finally:
            self._close()

    def _close(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
        with self._lock:
            self.sender.close()
            self.epoch = None
