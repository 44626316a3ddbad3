"""The weight-update group (docs/design.md §5.6): trainer rank 0 and the inference servers' ranks in a
torch.distributed group of their own (join, form, broadcast, leave), over which rlkube.core.weights.wire's updates
travel.

Why a group of its own (TCPStore + PrefixStore + ProcessGroupGloo/NCCL built by hand) and not the default
process group: the trainer may already use the default group for its own ranks, the inference servers are not
part of the training job, and the group has to be rebuilt when either side restarts. A hand-built group can be
dropped and rebuilt any number of times inside one process; the default group cannot.

Ranks: the trainer is rank 0 and hosts the TCPStore at RLKUBE_WEIGHT_SYNC_ADDR; inference server i is rank 1+i.

Epochs: every group lives under its own store prefix (an epoch id). The trainer `open()`s an epoch, announces it
in its `weights_ready` event BEFORE the transfer, and the group is formed by the first `send()` of that epoch
(which waits until every inference server has joined). A restarted trainer opens a new epoch on a new store; an
inference server that sees an unknown epoch in `weights_ready` leaves its old group and joins the new one. When
an inference server dies, the trainer's next `send()` fails (`WeightSyncError`): the trainer opens a new epoch
and announces it again, and the restarted server (which skips epochs whose group is already formed) joins it.
A restarted server that finds the current epoch already formed also files a rejoin request in the store, so the
trainer re-announces without waiting for its next step (which may never come while that server is missing).

Transport handshake: both ends derive the transport (and the transfer dtype) from one rule
(rlkube.contract.weight_transport). The trainer writes its choice under the epoch's prefix when it opens the epoch;
each receiver writes its own beside it and compares before it forms anything: a receiver that derived another
transport raises TransportMismatch naming both at once, and so does the trainer when it reads that receiver's
answer before forming the group. No collective (no NCCL call) runs before both ends agree.

Streamed receive: `WeightReceiver.receive_streamed` hands each bucket's tensors to the engine as the bucket
arrives (a buffer per bucket, or one reused buffer for an engine that copies each tensor at once) and checks
every tensor's sum before the engine sees it: an update costs the receiver about one bucket of memory (the
largest: a tensor larger than `bucket_bytes` travels alone), never a copy of the model.
`WeightPublisher` (rlkube.core.weights.publication) does that announce/send/reopen dance for the trainer.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson
import torch
import torch.distributed as dist

from rlkube.contract import weight_transport
from rlkube.contract.runtime import ENV_BIND_HOST
from rlkube.contract.weight_transport import TransportMismatch
from rlkube.core.weights.wire import (ADAPTER, DEFAULT_BUCKET_BYTES, DTYPES, FULL, PackedWeights,
                                      StreamedWeights, checksums_match, combine_sums, dtype_name, pack_weights,
                                      tensor_sum, unpack_weights, weights_checksum)

log = logging.getLogger(__name__)

BACKENDS = weight_transport.BUILT
_FORMED = "formed"  # store key (under the epoch prefix) set by the trainer once the group is complete
_REJOIN = "rejoin"  # store key (under the epoch prefix) a restarted inference server adds to ask for a new epoch
_CURRENT = "weights/current_epoch"  # store key: the epoch the trainer is using now
_TRANSPORT = "transport"  # store key (under the epoch prefix): the trainer's {"transport", "dtype"}
_HELLO = "hello"  # store keys hello/<rank> (under the epoch prefix): each receiver's {"transport", "dtype"}


class WeightSyncError(RuntimeError):
    """The group broke (a peer died, a timeout): the trainer reopens a new epoch, a receiver waits for one."""


class StaleEpoch(WeightSyncError):
    """The announced epoch's group was already formed without us (we restarted): wait for the next epoch."""


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight-sync address {addr!r} is not host:port (RLKUBE_WEIGHT_SYNC_ADDR)")
    return host.strip("[]"), int(port)


def check_backend(backend: str, available: bool = True) -> None:
    """`backend` is the transport (rlkube.contract.weight_transport); `available`: also check this torch has it."""
    if backend == weight_transport.CUDA_IPC:
        raise ValueError("weight-sync transport `cuda-ipc` (the engine on the trainer's GPU, a colocated placement) "
                         "is not built yet: place the engines on devices of their own")
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend {backend!r} is not one of {BACKENDS}")
    if available and backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("weight-sync backend `nccl` needs a CUDA build of torch (this one has no NCCL); use gloo")


def _handshake(transport: str, dtype: torch.dtype | str | None) -> bytes:
    if isinstance(dtype, torch.dtype):
        dtype = dtype_name(dtype)
    return orjson.dumps({"transport": transport, "dtype": dtype})


def _disagreement(trainer: dict[str, Any], receiver: dict[str, Any]) -> str | None:
    """What trainer and receiver disagree on (None: nothing); a None dtype on either side is not checked."""
    if trainer.get("transport") != receiver.get("transport"):
        return (f"the trainer sends over {trainer.get('transport')!r}, the receiver joins over "
                f"{receiver.get('transport')!r}")
    if trainer.get("dtype") and receiver.get("dtype") and trainer["dtype"] != receiver["dtype"]:
        return (f"the trainer sends weights in {trainer['dtype']}, the receiver expects {receiver['dtype']} (the "
                "dtype it serves: weightTransfer.dtype auto)")
    return None


def make_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta,
               host: str | None) -> dist.ProcessGroup:
    """Form the group; blocks until all `world_size` ranks have called this with the same store."""
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        # Advertise an address the peers can reach: the host we were told about (a pod's DNS name or IP), not
        # whatever the local hostname resolves to (often 127.0.1.1 inside containers).
        if host and host not in ("0.0.0.0", "::", ""):
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)
    check_backend(backend)  # the sender checks NCCL only here: after the handshake, so a mismatch is named first
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def drop_group(pg: dist.ProcessGroup | None) -> None:
    if pg is None:
        return
    try:
        # What makes a peer blocked in a collective fail at once is the group's destruction (it closes the
        # connections) when the caller drops its reference; gloo's abort() does nothing (torch 2.13), NCCL's
        # aborts the communicators. The destructor waits for a collective still running in this process, so
        # never drop a group another thread is blocked in (the inference server leaves such a one alone).
        pg.abort()
    except Exception as exc:  # noqa: BLE001 - best effort on a group that is already broken
        log.debug("weight-sync group abort: %s", exc)


class _Endpoint:
    """What sender and receiver share: the group of the current epoch and the object/tensor broadcasts."""

    def __init__(self, addr: str, rank: int, world_size: int, timeout_s: float, backend: str, device: str):
        check_backend(backend, available=rank != 0)
        if world_size < 2:
            raise ValueError(f"weight-sync world size {world_size} < 2: there must be at least one inference rank")
        if not 0 <= rank < world_size:
            raise ValueError(f"weight-sync rank {rank} outside world size {world_size}")
        self.host, self.port = parse_addr(addr)
        self.rank = rank
        self.world_size = world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend
        self.device = torch.device(device if backend == "gloo" else (device if device != "cpu" else "cuda"))
        self.epoch: str | None = None
        self.pg: dist.ProcessGroup | None = None

    def _bcast(self, tensor: torch.Tensor) -> None:
        self._bcast_all([tensor])

    def _bcast_all(self, tensors: list[torch.Tensor]) -> None:
        """One broadcast per tensor, in order, all issued before the first wait: the backend runs them back to
        back, and this thread does not need the GIL between two tensors (on an inference server busy
        generating, each GIL hand-over can cost the 5 ms switch interval)."""
        try:
            works = [self.pg.broadcast([t], dist.BroadcastOptions()) for t in tensors]  # root rank 0 (default)
            for work in works:
                work.wait()
        except Exception as exc:
            raise WeightSyncError(f"weight-sync broadcast failed in epoch {self.epoch}: {exc}") from exc

    def _bcast_object(self, obj: Any) -> Any:
        """Broadcast a JSON-able object from rank 0 (other ranks pass None and get the object back)."""
        if self.rank == 0:
            payload = orjson.dumps(obj)
            size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._bcast(size)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self._bcast(data)
        return obj if self.rank == 0 else orjson.loads(data.cpu().numpy().tobytes())

    def _leave(self) -> None:
        drop_group(self.pg)
        self.pg = None
        self.epoch = None


class WeightSender(_Endpoint):
    """The trainer's side (rank 0). Hosts the TCPStore; one group per epoch."""

    def __init__(self, addr: str, world_size: int, timeout_s: float = 300, backend: str = "gloo",
                 device: str = "cpu", local_host: str | None = None, transfer_dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(addr, 0, world_size, timeout_s, backend, device)
        self._store: dist.TCPStore | None = None
        self.transfer_dtype = transfer_dtype
        self.bucket_bytes = bucket_bytes
        # The address inference servers reach us at: RLKUBE_BIND_HOST (the pod IP) rather than the store's DNS
        # name, which a headless Service may not publish before the pod is Ready.
        self.local_host = local_host or os.environ.get(ENV_BIND_HOST) or self.host

    def open(self) -> str:
        """Start a NEW epoch (dropping the current group, if any); returns the epoch id to announce."""
        self._leave()
        if self._store is None:
            # Bound once per process and kept: the port must stay ours across epochs. The server listens on
            # every interface, so inference pods reach it through the trainer's Service name.
            self._store = dist.TCPStore(
                "0.0.0.0", self.port, None, True, timeout=self.timeout, wait_for_workers=False, use_libuv=True
            )
        self.epoch = f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
        # The handshake before the epoch is current: a receiver that sees the epoch finds the transport too.
        self._prefixed().set(_TRANSPORT, _handshake(self.backend, self.transfer_dtype))
        self._store.set(_CURRENT, self.epoch)
        return self.epoch

    def _prefixed(self) -> dist.PrefixStore:
        return dist.PrefixStore(f"weights/{self.epoch}/", self._store)

    def rejoin_requested(self) -> bool:
        """True when an inference server found the current epoch formed without it (it restarted)."""
        return self.epoch is not None and self._store is not None and self._prefixed().check([_REJOIN])

    def form(self) -> None:
        """Form the current epoch's group now (send() does it on first use); blocks until every rank joined."""
        if self.epoch is None:
            raise RuntimeError("WeightSender.form() before open()")
        if self.pg is None:
            self._form()

    def _agree(self, store: dist.Store) -> None:
        """Wait until every receiver wrote its side of the handshake; TransportMismatch if one disagrees."""
        hellos = [f"{_HELLO}/{rank}" for rank in range(1, self.world_size)]
        try:
            store.wait(hellos, self.timeout)
        except Exception as exc:
            raise WeightSyncError(f"weight-sync epoch {self.epoch}: not every inference rank arrived: {exc}") from exc
        ours = orjson.loads(store.get(_TRANSPORT))
        for rank, key in enumerate(hellos, start=1):
            why = _disagreement(ours, orjson.loads(store.get(key)))
            if why:
                raise TransportMismatch(f"weight-sync epoch {self.epoch}: inference rank {rank} refused to join: "
                                        f"{why} (both derive it from rlkube.contract.weight_transport)")

    def _form(self) -> None:
        store = self._prefixed()
        t0 = time.monotonic()
        self._agree(store)
        try:
            self.pg = make_group(store, 0, self.world_size, self.backend, self.timeout, self.local_host)
        except Exception as exc:
            raise WeightSyncError(f"forming weight-sync group of epoch {self.epoch} failed: {exc}") from exc
        store.set(_FORMED, "1")
        log.info("weight-sync epoch %s formed with %d ranks in %.2fs", self.epoch, self.world_size,
                 time.monotonic() - t0)

    def pack(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PackedWeights:
        """The update's snapshot in this sender's transfer dtype and buckets, on its device."""
        return pack_weights(named_tensors, self.transfer_dtype, self.bucket_bytes, self.device)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]] | PackedWeights, version: int) -> None:
        """Broadcast one update (named tensors, or what `pack` made of them). The first send of an epoch waits
        until every inference rank has joined.

        On failure the group is dropped and WeightSyncError raised: call open(), announce, send again.
        """
        if self.epoch is None:
            raise RuntimeError("WeightSender.send() before open(): open an epoch and announce it first")
        if isinstance(weights, StreamedWeights):
            return self._send_streamed(weights, version)
        packed = weights if isinstance(weights, PackedWeights) else self.pack(weights)
        try:
            if self.pg is None:
                self._form()
            self._bcast_object({"version": int(version), **packed.meta, "transport": self.backend})
            self._bcast_all(packed.buffers)
            self._bcast_object(None)
        except WeightSyncError:
            self._leave()
            raise

    def _send_streamed(self, weights: StreamedWeights, version: int) -> None:
        """The same wire format, each bucket sent as soon as the trainer ranks gathered it. The pass runs to its
        end even after a failed broadcast: the other trainer ranks are in its gathers (collectives)."""
        buckets = None
        try:
            if self.pg is None:
                self._form()
            self._bcast_object({"version": int(version), **weights.meta, "transport": self.backend})
            buckets = iter(weights.buckets())
            for flat in buckets:
                self._bcast(flat)
                del flat
            self._bcast_object(None)
        except (WeightSyncError, TransportMismatch):
            self._leave()
            if buckets is None:  # the pass never started: run it for the other ranks
                buckets = iter(weights.buckets())
            for _ in buckets:
                pass
            raise

    def close(self) -> None:
        """Leave the group (on training_finished; the inference servers leave on the same event)."""
        self._leave()
        self._store = None


class WeightReceiver(_Endpoint):
    """An inference server's side (rank 1+i)."""

    def __init__(self, addr: str, rank: int, world_size: int, timeout_s: float = 300, backend: str = "gloo",
                 device: str = "cpu", local_host: str | None = None, transfer_dtype: str | None = None):
        """`backend`: the transport the rule gives this receiver (rlkube.contract.weight_transport.receiver_transport);
        `transfer_dtype`: the dtype it expects the weights in (None: not checked)."""
        if rank < 1:
            raise ValueError(f"inference weight-sync rank must be >= 1 (rank 0 is the trainer), got {rank}")
        super().__init__(addr, rank, world_size, timeout_s, backend, device)
        self.transfer_dtype = transfer_dtype
        self.receiving: dict[str, Any] | None = None  # receive_streamed: the metadata of the update being loaded
        self.local_host = local_host or os.environ.get(ENV_BIND_HOST)
        self.last_checksum: float | None = None
        self.last_meta: dict[str, Any] | None = None  # the metadata of the last update received (its kind, adapter)

    def join(self, epoch: str) -> None:
        """Leave the current group and join `epoch`'s. Blocks until the trainer forms it (its first send).

        Raises StaleEpoch when that group was formed already (this server restarted after the announcement).
        """
        self._leave()
        try:
            store = dist.TCPStore(self.host, self.port, None, False, timeout=self.timeout, wait_for_workers=False)
        except Exception as exc:
            raise WeightSyncError(f"cannot reach the trainer's weight-sync store at {self.host}:{self.port}: {exc}") \
                from exc
        current = store.get(_CURRENT).decode() if store.check([_CURRENT]) else None
        if current != epoch:
            # The trainer restarted (a new store) or moved on; its announcement of `current` is on its way.
            raise StaleEpoch(f"weight-sync epoch {epoch} is not the trainer's current one ({current})")
        prefixed = dist.PrefixStore(f"weights/{epoch}/", store)
        if prefixed.check([_FORMED]):
            # We restarted after the group formed: ask the trainer for a new epoch (WeightPublisher's watchdog).
            prefixed.add(_REJOIN, 1)
            raise StaleEpoch(f"weight-sync epoch {epoch} was formed without this server; asked for a new one")
        # The handshake (module docstring): ours goes in first, so the trainer names the disagreement too.
        ours = _handshake(self.backend, self.transfer_dtype)
        try:
            prefixed.set(f"{_HELLO}/{self.rank}", ours)
            trainers = orjson.loads(prefixed.get(_TRANSPORT))
        except Exception as exc:
            raise WeightSyncError(f"weight-sync epoch {epoch}: no transport handshake from the trainer: {exc}") \
                from exc
        why = _disagreement(trainers, orjson.loads(ours))
        if why:
            raise TransportMismatch(f"weight-sync epoch {epoch}: inference rank {self.rank} cannot join: {why} "
                                    "(both derive it from rlkube.contract.weight_transport)")
        try:
            self.pg = make_group(prefixed, self.rank, self.world_size, self.backend, self.timeout, self.local_host)
        except Exception as exc:
            raise WeightSyncError(f"joining weight-sync epoch {epoch} failed: {exc}") from exc
        self.epoch = epoch

    @property
    def joined(self) -> bool:
        return self.pg is not None

    def receive(self, adapters: bool = False) -> tuple[int, dict[str, torch.Tensor]]:
        """Receive one update -> (version, {HF name: tensor in the transfer dtype}); its checksum, verified, is
        `last_checksum`, its metadata `last_meta`. An adapter update (kind "lora-adapter": PEFT names, see the
        module docstring) is refused with WeightSyncError unless `adapters`. On failure the group is dropped
        (WeightSyncError)."""
        if self.pg is None:
            raise RuntimeError("WeightReceiver.receive() before join()")
        try:
            meta = self._bcast_object(None)
            if not isinstance(meta, dict) or "tensors" not in meta or "buckets" not in meta:
                raise WeightSyncError(f"weight-sync protocol error: expected metadata, got {meta!r}")
            buffers = []
            for first, end, dtype, numel in meta["buckets"]:
                if dtype not in DTYPES:
                    raise WeightSyncError(f"weight-sync: tensors {first}..{end - 1} have unsupported dtype {dtype}")
                buffers.append(torch.empty(numel, dtype=DTYPES[dtype], device=self.device))
            self._bcast_all(buffers)
            end = self._bcast_object(None)
            if end is not None:
                raise WeightSyncError(f"weight-sync protocol error: expected the end sentinel, got {end!r}")
            kind = meta.get("kind", FULL)
            if kind not in (FULL, ADAPTER) or (kind == ADAPTER and not adapters):
                raise WeightSyncError(f"weight-sync: version {meta['version']} is a {kind!r} update, which this "
                                      "engine does not serve (it takes full weights)")
            state = unpack_weights(meta, buffers)
            checksum = weights_checksum(state.items())
            if not checksums_match(checksum, float(meta["checksum"])):
                raise WeightSyncError(f"weight-sync: version {meta['version']} arrived with checksum {checksum!r}, "
                                      f"the trainer sent {meta['checksum']!r}")
        except WeightSyncError:
            self._leave()
            raise
        self.last_checksum = checksum
        self.last_meta = {k: v for k, v in meta.items() if k not in ("tensors", "buckets")}
        return int(meta["version"]), state

    def receive_streamed(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
                         adapters: bool = False, reuse: bool = False) -> int:
        """Receive one update into the served model as it arrives -> its version: `load` is called once with an
        iterator of (HF name, tensor in the transfer dtype), bucket by bucket. Each bucket gets a buffer of its own,
        released once `load` drops its tensors (vLLM's layerwise reload holds a layer's tensors until the layer is
        complete, which may span two buckets); with `reuse`, for a `load` that copies each tensor before it asks
        for the next (`copy_` into parameters), every bucket lands in one buffer of the largest bucket's size.
        The checksum is summed as the tensors go by: each bucket's tensors are checked against the sums the
        trainer sent for them (a packed update carries them: `sums`) BEFORE `load` sees any of them, and the whole
        after the last bucket (`last_checksum`, `last_meta` as for `receive`). A bad bucket ends the stream there
        (the rest is received and dropped) and raises WeightSyncError; `load` is not even called when the first
        bucket is bad, but took the buckets before a later bad one, so a caller that loads in place must not serve
        a model that took any. On any failure the group is dropped."""
        if self.pg is None:
            raise RuntimeError("WeightReceiver.receive_streamed() before join()")
        try:
            meta = self._bcast_object(None)
            if not isinstance(meta, dict) or "tensors" not in meta or "buckets" not in meta:
                raise WeightSyncError(f"weight-sync protocol error: expected metadata, got {meta!r}")
            for first, end, dtype, _numel in meta["buckets"]:
                if dtype not in DTYPES:
                    raise WeightSyncError(f"weight-sync: tensors {first}..{end - 1} have unsupported dtype {dtype}")
            kind = meta.get("kind", FULL)
            version = int(meta["version"])
            largest = max((numel * DTYPES[dtype].itemsize for _, _, dtype, numel in meta["buckets"]), default=0)
            buffer = torch.empty(largest, dtype=torch.uint8, device=self.device) if reuse else None
            specs, sums, received, bad = meta["tensors"], [], [0], []
            sent = meta.get("sums")  # each tensor's sum (a packed update's; a streamed trainer's has none)
            buckets = meta["buckets"]

            def bucket(k: int) -> list[tuple[str, torch.Tensor]]:
                """Receive bucket k and check each of its tensors' sums (a bad one goes to `bad`)."""
                first, end, dtype, numel = buckets[k]
                flat = (buffer[:numel * DTYPES[dtype].itemsize].view(DTYPES[dtype]) if reuse
                        else torch.empty(numel, dtype=DTYPES[dtype], device=self.device))
                self._bcast(flat)
                received[0] += 1
                out, offset = [], 0
                for i, (name, shape, _) in enumerate(specs[first:end], start=first):
                    n = math.prod(shape)
                    t = flat[offset:offset + n].view(shape)
                    offset += n
                    sums.append((name, tensor_sum(t)))
                    if sent is not None and not checksums_match(sums[-1][1], float(sent[i])):
                        bad.append(f"{name} arrived with sum {sums[-1][1]!r}, the trainer sent {sent[i]!r}")
                    out.append((name, t))
                return out

            def drain(k: int) -> None:
                """The rest of the update, received and dropped: the group stays in step with the trainer."""
                for j in range(k, len(buckets)):
                    bucket(j)

            def end() -> None:
                """The end sentinel, taken even from a refused update: the trainer's send completes."""
                sentinel = self._bcast_object(None)
                if sentinel is not None:
                    raise WeightSyncError(f"weight-sync protocol error: expected the end sentinel, got {sentinel!r}")

            # A bucket is handed on only once all its tensors passed; the first is received before `load` is
            # called at all, so a bad first bucket (or an update this engine does not serve) loads nothing.
            head = bucket(0) if buckets else []
            if bad or kind not in (FULL, ADAPTER) or (kind == ADAPTER and not adapters):
                drain(1)
                end()
                if bad:
                    raise WeightSyncError(f"weight-sync: version {version} failed its checksum: {bad[0]}")
                raise WeightSyncError(f"weight-sync: version {version} is a {kind!r} update, which this engine "
                                      "does not serve (it takes full weights)")

            def tensors() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal head
                current, head = head, None
                for k in range(len(buckets)):
                    if k:
                        current = bucket(k)
                        if bad:
                            drain(k + 1)
                            return  # this bucket is never loaded
                    yield from current
                    current = None  # only `load` keeps this bucket alive now

            # What `load` may look at: the metadata of the update it is loading (its kind, adapter).
            self.receiving = {k: v for k, v in meta.items() if k not in ("tensors", "buckets")}
            load(tensors())
            if received[0] == len(buckets):
                end()
            if bad:
                raise WeightSyncError(f"weight-sync: version {version} failed its checksum after part of it was "
                                      f"loaded: {bad[0]}")
            if received[0] != len(buckets):
                raise WeightSyncError(f"weight-sync: the engine loaded {received[0]} of {len(buckets)} "
                                      f"buckets of version {version}")
            del buffer
            checksum = combine_sums(sums)
            if not checksums_match(checksum, float(meta["checksum"])):
                raise WeightSyncError(f"weight-sync: version {version} arrived with checksum {checksum!r}, "
                                      f"the trainer sent {meta['checksum']!r}")
        except BaseException:
            self._leave()  # mid-update (a failed load too): the group is out of step
            raise
        self.last_checksum = checksum
        self.last_meta, self.receiving = self.receiving, None
        return version

    def close(self) -> None:
        self._leave()
