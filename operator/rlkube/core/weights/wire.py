"""The weight update's wire format (docs/design.md §5.6): what one update is (header, buckets, checksum), whatever
carries it (rlkube.core.weights.group broadcasts it).

Why apart from the transport: the trainer's publisher, the native engine and vLLM's workers must agree byte for
byte on one update, for gloo and NCCL alike, for full weights and LoRA adapters, packed or streamed from FSDP
shards (`plan_buckets` decides both layouts). The contract (HF names, the transfer dtype, buckets, the checksum,
`kind`) and the wire (a JSON metadata object as an int64 length plus bytes, the buckets, a `null` sentinel; no
pickle) are docs/design.md §5.6.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float32, torch.float16, torch.bfloat16, torch.float64,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}


DEFAULT_BUCKET_BYTES = 64 * 2**20
CHECKSUM_REL_TOL = 1e-9  # float64 sums of the same values in another order differ in the last bits only


def transfer_dtype(name: str, served: str = "float32") -> torch.dtype:
    """`spec.trainer.weightTransfer.dtype` as a torch dtype; `auto` is `served`, the dtype the engines serve
    (`spec.model.dtype`: rlkube.contract.weight_transport.transfer_dtype_name), which the receiver checks at join."""
    return DTYPES[served if name == "auto" else name]


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
        sums.append((name, tensor_sum(t)))
    return combine_sums(sums)


SUM_CHUNK = 2**16
"""Elements summed at once by `tensor_sum`: `sum(dtype=float64)` of a whole tensor converts all of it to float64
first (four times a bfloat16 tensor's bytes), which a streamed receive cannot afford for a 150k-vocabulary
embedding; small chunks also keep the allocator from growing its heap (measured: 4 MiB extra at 2**16 elements,
26 MiB at 2**20, for a 16 MiB tensor)."""


def tensor_sum(t: torch.Tensor) -> float:
    """The float64 sum of a tensor's values, converted a chunk at a time (SUM_CHUNK elements)."""
    flat = t.detach().reshape(-1)
    return math.fsum(float(flat[i:i + SUM_CHUNK].double().sum()) for i in range(0, flat.numel(), SUM_CHUNK))


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
    return sum(numel * DTYPES[dtype].itemsize for _, _, dtype, numel in meta["buckets"])


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
        if dtype_name(t.dtype) not in DTYPES:
            raise ValueError(f"weight {name}: dtype {t.dtype} cannot be transferred")
        tensors.append((name, t))
    specs = [[n, list(t.shape), dtype_name(t.dtype)] for n, t in tensors]
    bucket_meta = plan_buckets(specs, bucket_bytes)
    # torch.cat copies: the buffers are a snapshot even when no cast happened.
    buffers = [torch.cat([tensors[i][1].reshape(-1) for i in range(first, end)])
               for first, end, _, _ in bucket_meta]
    # Each tensor's sum too: a streamed receiver checks every tensor before it loads it (rlkube.core.weights.group).
    sums = [tensor_sum(t) for _, t in tensors]
    meta = {"tensors": specs, "buckets": bucket_meta, "checksum": combine_sums(zip([n for n, _ in tensors], sums)),
            "sums": sums, "kind": FULL if adapter is None else ADAPTER}
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
        size = numel * DTYPES[dtype].itemsize
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
            flat = torch.empty(numel, dtype=DTYPES[dtype], device=self.device) if materialize else None
            offset, flat_bytes = 0, numel * DTYPES[dtype].itemsize if materialize else 0
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
