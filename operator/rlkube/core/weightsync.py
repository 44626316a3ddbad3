"""Weight updates trainer -> inference servers over a dedicated torch.distributed group (docs/design.md §5.6).

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
`WeightPublisher` below does that announce/send/reopen dance for the trainer.

The weight contract (docs/design.md §5.6), whatever the trainer backend:
- names: the Hugging Face parameter names of the job's model directory, each tied weight once (the backend's
  `weights()`, see rlkube.core.backends.base), so any engine that loads the directory can apply an update by name;
- dtype: the trainer casts every floating-point tensor to the transfer dtype (`spec.trainer.weightTransfer.dtype`:
  bfloat16 on GPUs, float32 on CPU by default; None keeps each tensor's own dtype) and the receiver converts to the
  dtype it serves (load_state_dict copies with conversion). Non-float tensors (integer buffers) keep theirs.
- buckets: consecutive tensors of one dtype are flattened into one buffer of at most `bucket_bytes`
  (`weightTransfer.bucketMegabytes`; a larger tensor gets a bucket of its own), one broadcast per bucket rather
  than one per tensor;
- checksum: the sender puts `weights_checksum()` of what it sends into the metadata; the receiver recomputes it on
  what arrived and refuses an update that differs, and an engine can report the checksum of what it serves
  (`weights_checksum` of its weights cast to the transfer dtype: equal to the trainer's whenever the served dtype
  holds the transfer dtype exactly, e.g. float32 or bfloat16 served from a bfloat16 transfer).

A trainer that shards its weights (FSDP) cannot pack a snapshot without holding the whole model on rank 0: it
publishes a `StreamedWeights` instead, which every trainer rank builds from its shards (names, shapes, dtypes and
the checksum need no gather) and whose buckets the ranks gather one at a time while rank 0 sends each; the bytes
on the wire are the same as for the packed update (`plan_buckets` decides both layouts).

Wire format of one update (identical for gloo on CPU and NCCL on GPUs): a metadata object
`{"version", "checksum", "kind", "tensors": [[name, shape, dtype], ...], "buckets": [[first, end, dtype, numel],
...]}`, then every bucket in that order (tensors `first..end-1` flattened), then a `null` sentinel. Objects travel
as a length (int64) followed by the JSON bytes (uint8), so no pickle crosses the wire.

`kind` says what the tensors are: "full" (absent in older senders: the same), every weight under its HF name; or
"lora-adapter" (an `AdapterUpdate`, or a sharded trainer's `StreamedWeights(adapter=...)`; spec.trainer.lora), the
adapter's A and B matrices under PEFT's names (rlkube.core.lora) with `adapter` in the metadata ({"format", "rank",
"alpha", "scaling", "target_modules"}): the receiver serves base + adapter, W = W0 + scaling x B @ A on its own base copy. `WeightReceiver.receive` refuses an
adapter update unless its caller said it serves adapters (`adapters=True`), so no engine loads one as weights.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
import redis
import torch
import torch.distributed as dist

from rlkube.contract import protocol
from rlkube.contract.runtime import ENV_BIND_HOST

log = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
_FORMED = "formed"  # store key (under the epoch prefix) set by the trainer once the group is complete
_REJOIN = "rejoin"  # store key (under the epoch prefix) a restarted inference server adds to ask for a new epoch
_CURRENT = "weights/current_epoch"  # store key: the epoch the trainer is using now

_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


DEFAULT_BUCKET_BYTES = 64 * 2**20
CHECKSUM_REL_TOL = 1e-9  # float64 sums of the same values in another order differ in the last bits only


def transfer_dtype(name: str, device: str | torch.device = "cpu") -> torch.dtype:
    """`spec.trainer.weightTransfer.dtype` as a torch dtype (`auto`: bfloat16 on GPUs, float32 on CPU)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> float:
    """A cheap fingerprint of a set of weights: per tensor, the float64 sum of its values (cast to `dtype`
    first, when given), combined as sum over tensors sorted by name of (position + 1) x that sum, so a tensor
    under the wrong name changes it too. Values in the transfer dtype are exact in float64, so trainer and engine
    agree up to summation order (compare with CHECKSUM_REL_TOL)."""
    sums = []
    for name, t in named_tensors:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        sums.append((name, float(t.sum(dtype=torch.float64))))
    return combine_sums(sums)


def combine_sums(sums: Iterable[tuple[str, float]]) -> float:
    """`weights_checksum` from each tensor's float64 sum (a sharded trainer sums its shards' sums)."""
    return math.fsum((i + 1) * s for i, (_, s) in enumerate(sorted(sums)))


def checksums_match(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=CHECKSUM_REL_TOL, abs_tol=1e-6)


FULL = "full"
ADAPTER = "lora-adapter"


@dataclass
class AdapterUpdate:
    """A weight update that carries a LoRA adapter, not the weights (module docstring: `kind`): iterate it for the
    (PEFT name, tensor) pairs; `config` goes into the metadata as `adapter`."""

    tensors: list[tuple[str, torch.Tensor]]
    config: dict[str, Any]

    def __iter__(self):
        return iter(self.tensors)


def update_nbytes(meta: dict[str, Any]) -> int:
    """Bytes of tensor data an update with this metadata puts on the wire (its buckets)."""
    return sum(numel * _DTYPES[dtype].itemsize for _, _, dtype, numel in meta["buckets"])


@dataclass
class PackedWeights:
    """One update ready to send: the metadata object and the bucket buffers (already in the transfer dtype, on
    the sending device). Packing is also the snapshot: the trainer may change its weights once it returns."""

    meta: dict[str, Any]
    buffers: list[torch.Tensor]


def pack_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str | torch.device | None = None) -> PackedWeights:
    """Cast floating-point tensors to `dtype` (None: keep) and flatten consecutive same-dtype tensors into buckets
    of at most `bucket_bytes` (a larger tensor alone). An AdapterUpdate is packed as kind "lora-adapter"."""
    adapter = named_tensors.config if isinstance(named_tensors, AdapterUpdate) else None
    tensors = []
    for name, t in named_tensors:
        t = t.detach()
        if device is not None:
            t = t.to(device)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if dtype_name(t.dtype) not in _DTYPES:
            raise ValueError(f"weight {name}: dtype {t.dtype} cannot be transferred")
        tensors.append((name, t))
    specs = [[n, list(t.shape), dtype_name(t.dtype)] for n, t in tensors]
    bucket_meta = plan_buckets(specs, bucket_bytes)
    # torch.cat copies: the buffers are a snapshot even when no cast happened.
    buffers = [torch.cat([tensors[i][1].reshape(-1) for i in range(first, end)])
               for first, end, _, _ in bucket_meta]
    meta = {"tensors": specs, "buckets": bucket_meta, "checksum": weights_checksum(tensors),
            "kind": FULL if adapter is None else ADAPTER}
    if adapter is not None:
        meta["adapter"] = dict(adapter)
    return PackedWeights(meta, buffers)


def plan_buckets(specs: list[list[Any]], bucket_bytes: int) -> list[list[Any]]:
    """The buckets ([first, end, dtype, numel]) of tensors `specs` ([name, shape, dtype name], in the transfer
    dtype): consecutive tensors of one dtype up to `bucket_bytes` together, a larger tensor alone. Shared by the
    packed and the streamed update, so both put the same bytes on the wire."""
    buckets: list[list[Any]] = []  # [first, end, dtype, numel, bytes]
    for i, (_, shape, dtype) in enumerate(specs):
        numel = math.prod(shape)
        size = numel * _DTYPES[dtype].itemsize
        last = buckets[-1] if buckets else None
        if last is not None and last[2] == dtype and last[4] + size <= bucket_bytes:
            last[1], last[3], last[4] = i + 1, last[3] + numel, last[4] + size
        else:
            buckets.append([i, i + 1, dtype, numel, size])
    return [b[:4] for b in buckets]


class StreamedWeights:
    """One update produced bucket by bucket, for a trainer whose weights are sharded over its ranks (FSDP): no
    rank ever holds the whole model. Every trainer rank builds it (a COLLECTIVE, like all its methods) from its
    shards: `specs` ([name, shape, dtype] of what is sent), `checksum` (summed from the shards' sums, so it may
    differ from `weights_checksum` of the full tensors in the last bits: CHECKSUM_REL_TOL), `gather(indices)`
    yields the full tensors of those specs one at a time (all ranks take part), and `agree(flag)` returns rank 0's
    flag on every rank.

    Rank 0's WeightPublisher runs passes: `more(True)`, then `buckets()` (each bucket gathered, cast into one flat
    buffer in the transfer dtype, sent, dropped), and `more(False)` once done (after a failed pass `more(True)`
    again, for the retry in a new epoch). Every other rank, and rank 0 when it transfers nothing, calls `drain()`,
    which runs as many passes as rank 0 announces. `peak_bytes` counts the most bytes of gathered tensors and
    bucket buffers this rank held at once (one bucket plus one full tensor).

    The price of streaming: the other ranks wait for rank 0's broadcast of a bucket inside their next gather, so
    a broadcast that blocks (an inference server that neither receives nor dies) fails them after the trainer's
    collective timeout (RLKUBE_COLLECTIVE_TIMEOUT_S, 120 s) rather than the weight-sync timeout; a dead server
    breaks the broadcast at once, and the retry runs in a new epoch as for the packed update."""

    def __init__(self, specs: list[list[Any]], checksum: float, gather, agree, bucket_bytes: int,
                 device: str | torch.device | None = None, rendezvous=None, adapter: dict[str, Any] | None = None):
        self.meta = {"tensors": specs, "buckets": plan_buckets(specs, bucket_bytes), "checksum": checksum,
                     "kind": FULL if adapter is None else ADAPTER}
        if adapter is not None:  # a LoRA adapter streamed from its shards, marked as AdapterUpdate's packing is
            self.meta["adapter"] = dict(adapter)
        self._gather, self._agree, self._rendezvous = gather, agree, rendezvous
        self.device = device
        self.passes = 0
        self.peak_bytes = 0

    def more(self, flag: bool) -> bool:
        """COLLECTIVE: rank 0's `flag` (another pass follows) on every rank."""
        return bool(self._agree(flag))

    def buckets(self) -> Iterable[torch.Tensor]:
        """COLLECTIVE: one pass, every bucket's flat buffer in order (consume it fully)."""
        return self._pass(materialize=True)

    def _pass(self, materialize: bool) -> Iterable[torch.Tensor | None]:
        self.passes += 1
        if self._rendezvous is not None:
            # Rank 0 gets here only once its weight-sync group formed (minutes at start-up, waiting for the
            # inference servers): meet outside the gathers, which fail after the collective timeout.
            self._rendezvous(self.passes)
        for first, end, dtype, numel in self.meta["buckets"]:
            # A rank that sends nothing only takes part in the gathers (and drops each tensor at once).
            flat = torch.empty(numel, dtype=_DTYPES[dtype], device=self.device) if materialize else None
            offset, flat_bytes = 0, numel * _DTYPES[dtype].itemsize if materialize else 0
            for full in self._gather(range(first, end)):
                n = full.numel()
                self.peak_bytes = max(self.peak_bytes, flat_bytes + n * full.element_size())
                if flat is not None:
                    flat[offset:offset + n].copy_(full.reshape(-1))  # casts to the transfer dtype
                offset += n
                del full
            if offset != numel:
                raise RuntimeError(f"weight stream: tensors {first}..{end - 1} gave {offset} values, not {numel}")
            yield flat
            del flat

    def drain(self) -> None:
        """COLLECTIVE: take part in every pass rank 0 runs, sending nothing."""
        while self.more(False):
            for _ in self._pass(materialize=False):
                pass


def unpack_weights(meta: dict[str, Any], buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The named tensors (views into the buffers) of a received update."""
    specs = meta["tensors"]
    state: dict[str, torch.Tensor] = {}
    for (first, end, _dtype, _numel), flat in zip(meta["buckets"], buffers, strict=True):
        offset = 0
        for name, shape, _ in specs[first:end]:
            n = math.prod(shape)
            state[name] = flat[offset:offset + n].view(shape)
            offset += n
    return state


class WeightSyncError(RuntimeError):
    """The group broke (a peer died, a timeout): the trainer reopens a new epoch, a receiver waits for one."""


class StaleEpoch(WeightSyncError):
    """The announced epoch's group was already formed without us (we restarted): wait for the next epoch."""


def parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight-sync address {addr!r} is not host:port (RLKUBE_WEIGHT_SYNC_ADDR)")
    return host.strip("[]"), int(port)


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"weight-sync backend {backend!r} is not one of {BACKENDS}")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ValueError("weight-sync backend `nccl` needs a CUDA build of torch (this one has no NCCL); use gloo")


def _make_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: datetime.timedelta,
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
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def _drop_group(pg: dist.ProcessGroup | None) -> None:
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
        _check_backend(backend)
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
        _drop_group(self.pg)
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

    def _form(self) -> None:
        store = self._prefixed()
        t0 = time.monotonic()
        try:
            self.pg = _make_group(store, 0, self.world_size, self.backend, self.timeout, self.local_host)
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
            self._bcast_object({"version": int(version), **packed.meta})
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
            self._bcast_object({"version": int(version), **weights.meta})
            buckets = iter(weights.buckets())
            for flat in buckets:
                self._bcast(flat)
                del flat
            self._bcast_object(None)
        except WeightSyncError:
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
                 device: str = "cpu", local_host: str | None = None):
        if rank < 1:
            raise ValueError(f"inference weight-sync rank must be >= 1 (rank 0 is the trainer), got {rank}")
        super().__init__(addr, rank, world_size, timeout_s, backend, device)
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
        try:
            self.pg = _make_group(prefixed, self.rank, self.world_size, self.backend, self.timeout, self.local_host)
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
                if dtype not in _DTYPES:
                    raise WeightSyncError(f"weight-sync: tensors {first}..{end - 1} have unsupported dtype {dtype}")
                buffers.append(torch.empty(numel, dtype=_DTYPES[dtype], device=self.device))
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

    def close(self) -> None:
        self._leave()


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

    def __init__(self, redis_client, keys: protocol.StreamKeys, addr: str, world_size: int,
                 timeout_s: float = 300, backend: str = "gloo", device: str = "cpu", retries: int = 3,
                 watch_interval_s: float = 0.5, local_host: str | None = None, overlap: bool = False,
                 transfer_dtype: torch.dtype | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.redis = redis_client
        self.keys = keys
        self.streams = True  # takes a StreamedWeights (the sharded trainer passes one instead of named tensors)
        # Streamed updates: an inference server asked to rejoin and the trainer must publish again (its ranks
        # gather the weights anew); set by the watchdog, cleared by the next publish, which opens a new epoch.
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
        fields = protocol.weights_ready(step, documents_seen, epoch=self.epoch, version=int(version),
                                        checksum=checksum, **extra)
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
