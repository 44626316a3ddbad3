"""The inference side of Fast-LLM's weight broadcast (`trainer.backend: fast-llm`).

A Fast-LLM trainer does not speak our weight-sync protocol (rlkube.core.weights: epochs, JSON metadata,
buckets, a checksum); it broadcasts the way its streaming callback does, and both engines receive exactly that.
Every fact below is Fast-LLM's at the commit rlkube.controller.manifests.fastllm.FAST_LLM_COMMIT (d3d20226, the one
tests/fixtures/fast_llm_config_fields.json records), cited file:line; PipelineRL's receiver on its `fast-llm`
branch (pipelinerl/vllm1.py, init_actor_update_group and receive_weight_update_fast_llm) does the same.

Rendezvous (once, at start-up, before any weights_ready):
- Fast-LLM's rank 0 builds a ProcessGroupPool of `world_size = external_world_size + 1` ranks with itself as
  rank 0 at `tcp://{broadcast.host}:{broadcast.port}` (fast_llm/engine/training/streaming.py:42-53), which calls
  `torch.distributed.rendezvous(init_method, rank, world_size, timeout)` (fast_llm/engine/distributed/
  distributed.py:65-72). The receivers do the same with their own rank: one rank per tensor-parallel worker of
  every inference server, `1 + index x tensorParallel + tp_rank` (rlkube.contract.runtime.weight_sync_rank; PipelineRL:
  `pg_rank = 1 + actor_idx * actor_ngpus + self.rank`), so `external_world_size = replicas x tensorParallel`.
- The group is `get_process_group(range(world_size), 0)` (streaming.py:54): the backend's process group class on
  `PrefixStore("range_0_{world_size}_1/", store)`, group rank = rank, size = world_size
  (distributed.py:112-122), i.e. ProcessGroupGloo or ProcessGroupNCCL per `broadcast.backend`.
- The rendezvous happens in the callback's constructor, before training starts: Fast-LLM's rank 0 waits there
  until every receiver joined, so the receivers join at start-up, not on an event.

One update (streaming.py:97-119), after each successful step and once at run begin (streaming.py:57-74):
- first the event: XADD `fast_llm_events` {"event": JSON {"type": "weights_ready", "step", "documents_seen"}}
  (streaming.py:99-106): no epoch, no version (the step is the version);
- then, for each `(shard_name, layer_name, tensor)` of `iter_checkpoint(export)` (streaming.py:112-116), in that
  order: `broadcast_object((shard_name, layer_name, tensor.shape, tensor.dtype))` then `broadcast(tensor)`;
  with the export format a Hugging Face one the names are the checkpoint's HF names and the shard is "weights"
  (fast_llm/engine/checkpoint/huggingface.py:100-102); tied weights are exported once (the tied output weight
  is dropped, fast_llm/models/gpt/conversion/llama.py:421-427), the dtype is the tensor's own;
- then `broadcast_object(None)`: the end marker (streaming.py:118-119).
- `broadcast_object` (fast_llm/core/distributed.py:179-198): the object pickled into a uint8 tensor
  (distributed.py:295-302), its size broadcast first as a one-element int64 tensor (`broadcast_scalar`,
  distributed.py:163-176), then the bytes; `broadcast` is the group's broadcast from root 0, root tensor 0
  (distributed.py:50-64). On gloo every buffer is on the CPU (distributed.py:30-36).
- `training_finished` (streaming.py:82-86) comes after the last update; Fast-LLM then shuts its group down.

Rejoining. Fast-LLM forms the group once, with a fixed world size, and has no epochs: an inference server that
restarts finds no group to join (Fast-LLM's next broadcast fails and the trainer pod restarts, forming the group
anew with every server). A restarted trainer announces nothing before its group is complete, so a receiver idle in
the dead trainer's group would never notice it: the trainer pod's launcher (rlkube.core.launch.fast_llm) writes a
fresh generation into the store it hosts and announces it (protocol.BROADCAST_OPENED) before Fast-LLM starts; a
receiver records the generation of the store it joined through (`generation`) and the inference shell rejoins on
an announcement of another one (rlkube.contract.fast_llm_rendezvous.GENERATION_KEY).
"""

from __future__ import annotations

import datetime
import io
import logging
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlkube.contract.fast_llm_rendezvous import (
    EPOCH,
    GENERATION_KEY,
    GENERATION_WAIT_S,
    WEIGHTS_SHARD,
    store_prefix,
)
from rlkube.core.weights.group import WeightSyncError, check_backend, drop_group, make_group, parse_addr
from rlkube.core.weights.wire import combine_sums, tensor_sum

log = logging.getLogger(__name__)

_DTYPE_NAMES = {str(dt).removeprefix("torch.") for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class _MetadataUnpickler(pickle.Unpickler):
    """Fast-LLM pickles `(str, str, torch.Size, torch.dtype)` (streaming.py:115): only those types are loaded,
    anything else in the bytes is refused rather than executed."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or name in _DTYPE_NAMES):
            return getattr(torch, name)
        raise WeightSyncError(f"Fast-LLM broadcast metadata refers to {module}.{name}: not shape or dtype")


def unpickle_metadata(data: bytes) -> Any:
    return _MetadataUnpickler(io.BytesIO(data)).load()


def store_generation(store) -> str | None:
    """The generation the trainer pod's launcher wrote in the broadcast store (GENERATION_KEY), None for a store
    without one (a Fast-LLM rank 0 not started by rlkube's launcher)."""
    try:
        if not store.check([GENERATION_KEY]):
            store.wait([GENERATION_KEY], datetime.timedelta(seconds=GENERATION_WAIT_S))
        return store.get(GENERATION_KEY).decode()
    except Exception:  # noqa: BLE001 - torch raises DistStoreError or a plain RuntimeError on the timeout
        return None


class FastLlmReceiver:
    """One receiving rank of Fast-LLM's broadcast group (an inference server, or one of its TP workers)."""

    def __init__(self, addr: str, rank: int, world_size: int, timeout_s: float = 300, backend: str = "gloo",
                 device: str = "cpu", local_host: str | None = None):
        check_backend(backend)
        if not 1 <= rank < world_size:
            raise ValueError(f"Fast-LLM broadcast rank {rank} outside 1..{world_size - 1} (rank 0 is the trainer)")
        self.host, self.port = parse_addr(addr)
        self.rank, self.world_size = rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.backend = backend
        # Fast-LLM's buffers: CPU on gloo, the current CUDA device on NCCL (distributed.py:30-36).
        self.device = torch.device("cpu" if backend == "gloo" else (device if device != "cpu" else "cuda"))
        self.local_host = local_host
        self.pg: dist.ProcessGroup | None = None
        self.epoch: str | None = None
        self.generation: str | None = None  # the broadcast store's (GENERATION_KEY) when joined
        # WeightReceiver's report of an update, for engines that take either: Fast-LLM's wire has no metadata (every
        # update is full weights) and no checksum of its own; `last_checksum` is of the tensors received.
        self.receiving: dict[str, Any] | None = None
        self.last_meta: dict[str, Any] | None = None
        self.last_checksum: float | None = None

    @property
    def joined(self) -> bool:
        return self.pg is not None

    def join(self, epoch: str | None = None) -> None:
        """Join the group (blocks until Fast-LLM's rank 0 and every other receiver have joined)."""
        if self.pg is not None:
            return
        try:
            # distributed.py:65-72: the same call Fast-LLM's rank 0 makes, with our rank (a store client).
            store, _, _ = next(dist.rendezvous(f"tcp://{self.host}:{self.port}", self.rank, self.world_size,
                                               timeout=self.timeout))
            generation = store_generation(store)
            prefixed = dist.PrefixStore(store_prefix(self.world_size), store)
            self.pg = make_group(prefixed, self.rank, self.world_size, self.backend, self.timeout, self.local_host)
        except Exception as exc:
            raise WeightSyncError(f"joining Fast-LLM's weight broadcast at {self.host}:{self.port} as rank "
                                  f"{self.rank} of {self.world_size} failed: {exc}") from exc
        self.epoch, self.generation = EPOCH, generation

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0  # distributed.py:55-57
        self.pg.broadcast([tensor], opts).wait()

    def _object(self) -> Any:
        size = torch.empty([1], dtype=torch.int64, device=self.device)  # distributed.py:172, 195
        self._broadcast(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)  # distributed.py:196-197
        self._broadcast(data)
        return unpickle_metadata(data.cpu().numpy().tobytes())  # distributed.py:305-306

    def receive(self) -> dict[str, torch.Tensor]:
        """One update: {HF name: tensor in the dtype Fast-LLM sent it}, in Fast-LLM's order, up to the end
        marker. The group is dropped on any failure (Fast-LLM cannot re-form it with us anyway)."""
        if self.pg is None:
            raise RuntimeError("FastLlmReceiver.receive() before join()")
        state: dict[str, torch.Tensor] = {}
        try:
            state.update(self._tensors())
        except WeightSyncError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            raise WeightSyncError(f"Fast-LLM weight broadcast failed: {exc}") from exc
        return state

    def receive_streamed(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
                         adapters: bool = False, reuse: bool = False) -> None:
        """One update loaded as it arrives, in WeightReceiver.receive_streamed's shape (`adapters` and `reuse` mean
        nothing here: Fast-LLM sends full weights, a buffer per tensor): `load` is called once with an iterator of
        (HF name, tensor in the dtype Fast-LLM sent it), tensor by tensor in Fast-LLM's order, so an update costs
        the receiver one tensor, not a copy of the model. What `load` leaves unread is received and dropped up to
        the end marker (the ranks stay in step); `last_checksum` is summed as the tensors go by. Returns None: the
        wire carries no version (the announcement's step is it). Raises WeightSyncError when the transfer failed,
        whatever `load` did with the error; the group is dropped on any failure (Fast-LLM cannot re-form it with
        us anyway)."""
        if self.pg is None:
            raise RuntimeError("FastLlmReceiver.receive_streamed() before join()")
        sums: list[tuple[str, float]] = []
        failure: list[BaseException] = []
        ended = [False]

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            try:
                for name, tensor in self._tensors():
                    sums.append((name, tensor_sum(tensor)))
                    yield name, tensor
            except BaseException as exc:
                failure.append(exc)
                raise
            ended[0] = True

        try:
            stream = tensors()
            load(stream)
            for _ in stream:  # what `load` left: received and dropped
                pass
        except BaseException:
            self.close()
            if failure:
                raise self._transfer_error(failure[0]) from failure[0]
            raise
        if failure or not ended[0]:
            self.close()
            error = failure[0] if failure else RuntimeError("the update ended before Fast-LLM's end marker")
            raise self._transfer_error(error) from error
        self.last_checksum = combine_sums(sums)
        return None

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of each weights-shard tensor of one update, up to the end marker."""
        while (meta := self._object()) is not None:
            if not (isinstance(meta, tuple) and len(meta) == 4):
                raise WeightSyncError(f"Fast-LLM broadcast: expected (shard, name, shape, dtype), got {meta!r}")
            shard, name, shape, dtype = meta
            if not isinstance(dtype, torch.dtype):
                raise WeightSyncError(f"Fast-LLM broadcast: {name} has no torch dtype ({dtype!r})")
            buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
            self._broadcast(buffer)  # every tensor, whatever its shard, or the ranks fall out of step
            if shard == WEIGHTS_SHARD:
                yield name, buffer

    @staticmethod
    def _transfer_error(exc: BaseException) -> WeightSyncError:
        return exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"Fast-LLM weight broadcast failed: {exc}")

    def close(self) -> None:
        pg, self.pg = self.pg, None
        drop_group(pg)
