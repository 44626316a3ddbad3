"""megatron-core on CPU: the small compatibility shim of docs/design.md §6, and megatron's process state.

megatron-core (0.16.1, the last release for Python 3.11) assumes CUDA in these places that a CPU forward and
backward of a GPTModel (with tensor parallelism too) reach:
1. the model-parallel RNG tracker (`tensor_parallel.random.CudaRNGStatesTracker`), forked around dropout, keeps
   CUDA generator states (`torch.cuda.get_rng_state`). `CpuRNGStatesTracker` keeps CPU generator states instead
   and forks the CPU default generator the same way;
2. `parallel_state`'s global memory buffer (`utils.GlobalMemoryBuffer`, used by the local attention for its
   score matrix) allocates on `torch.cuda.current_device()`. `DeviceMemoryBuffer` allocates on the model's device;
3. the local attention's default causal mask is built with `device="cuda"` when no mask is passed; the backend
   always passes its own mask (`causal_mask`);
4. `RotaryEmbedding.get_emb` moves its inverse frequencies to `torch.cuda.current_device()` on the first forward.
   `adapt_model` gives the model's rotary embedding `CpuRotaryEmbedding`'s `get_emb`, which leaves them in place;
5. the tensor-parallel output layer gathers the vocabulary shards of the logits (`parallel_output=False`) into a
   buffer allocated on `torch.cuda.current_device()` (`tensor_parallel.mappings._gather_along_last_dim`);
   `initialize` gives megatron `gather_along_last_dim`, the same gather into a buffer on the input's device (the
   other tensor-parallel mappings this model reaches without sequence parallelism, all-reduces and splits, allocate
   nothing);
6. activation recomputation (`recompute_granularity`, the backend's gradient checkpointing) saves and restores
   the CUDA generator's state around each recomputed block; a CPU process has no CUDA generator, so `initialize`
   makes those two functions save nothing and restore nothing (the CPU generator and the tracker's states are
   still saved and restored by megatron).
Everything else (model construction with `use_cpu_initialization`, the tensor-parallel layers, the transformer
block, megatron's process groups over gloo) runs unchanged. On a GPU none of this is installed: megatron's own
CUDA tracker is seeded.

megatron-core also needs torch.distributed and its model-parallel groups even for one rank: `initialize` starts
a one-rank group on an in-process HashStore (no port; gloo on CPU, NCCL on CUDA) unless the process already has
one (the trainer's ranks, rlkube.core.backends.torch_distributed), and builds megatron's tensor- and data-parallel
groups over it with `parallel_state.initialize_model_parallel`. The weight-update group (rlkube.core.weights)
is built by hand and does not touch the default group.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.distributed as dist

with warnings.catch_warnings():
    # "Transformer Engine and Apex are not installed. Falling back to ..." (expected: we use the local spec)
    warnings.simplefilter("ignore", UserWarning)
    warnings.simplefilter("ignore", DeprecationWarning)
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import mappings as megatron_mappings
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.utils import GlobalMemoryBuffer

MODEL_PARALLEL_RNG = megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME
SEED_OFFSET = 2718  # megatron's model_parallel_cuda_manual_seed offsets the tensor-parallel seed by this


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """megatron's RNG tracker over CPU generator states: `fork(name)` swaps the CPU default generator's state
    for the named one and back, so dropout inside the fork draws from the tracked stream."""

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} is not tracked")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


class DeviceMemoryBuffer(GlobalMemoryBuffer):
    """megatron's reusable scratch buffer, allocated on a given device instead of the current CUDA device."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = math.prod(tensor_shape)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < needed:
            buf = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype, device=self.device)
        return buf[:needed].view(*tensor_shape)


class CpuRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding with `get_emb` minus its move to the current CUDA device (megatron-core 0.16.1's
    body otherwise: the same frequencies, rotate-half or interleaved)."""

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]


def adapt_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Make a built GPTModel run on `device`; nothing changes on a GPU."""
    if device.type != "cuda":
        for module in model.modules():
            if type(module) is RotaryEmbedding:
                module.__class__ = CpuRotaryEmbedding  # same state, one method differs
    return model


def causal_mask(length: int, device: torch.device) -> torch.Tensor:
    """megatron's mask convention: [1, 1, T, T] bool, True where attention is NOT allowed (the future)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def gather_along_last_dim(input_: torch.Tensor, group) -> torch.Tensor:
    """megatron-core 0.16.1's `_gather_along_last_dim` with its buffer on the input's device."""
    world_size = group.size()
    if world_size == 1:
        return input_
    size = list(input_.size())
    size[0] *= world_size
    output = torch.empty(size, dtype=input_.dtype, device=input_.device)
    dist.all_gather_into_tensor(output, input_.contiguous(), group=group)
    return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    if new_state.numel():
        raise RuntimeError("a CUDA RNG state reached megatron's CPU shim")


def initialize(seed: int, device: torch.device, tensor_parallel: int = 1, timeout_s: float = 1800.0) -> None:
    """megatron's model-parallel state over this process's torch.distributed group (a one-rank group if it has
    none): tensor parallel `tensor_parallel`, data parallel over the remaining ranks, pipeline parallel 1; and the
    RNG tracker seeded like megatron's `model_parallel_cuda_manual_seed`. Safe to call again with the same sizes
    (a new seed); other sizes raise. `timeout_s`: the collective timeout of megatron's groups (whole minutes;
    megatron's default is 30), so that a dead tensor-parallel peer fails a step as fast as the trainer's group."""
    if not dist.is_initialized():
        if tensor_parallel > 1:
            raise RuntimeError(f"tensor parallel {tensor_parallel} needs the trainer's ranks (torch.distributed)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=1,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
            create_gloo_process_groups=False)  # only for megatron's distributed optimizer, which is not used
    elif parallel_state.get_tensor_model_parallel_world_size() != tensor_parallel:
        raise RuntimeError(f"megatron's model-parallel state has tensor parallel "
                           f"{parallel_state.get_tensor_model_parallel_world_size()}, not {tensor_parallel}")
    if device.type == "cuda":
        megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state
    megatron_mappings._gather_along_last_dim = gather_along_last_dim
    tracker = CpuRNGStatesTracker()
    # as model_parallel_cuda_manual_seed: each tensor-parallel rank draws its own stream
    tracker.add(MODEL_PARALLEL_RNG, seed + SEED_OFFSET + parallel_state.get_tensor_model_parallel_rank())
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    if not isinstance(parallel_state._GLOBAL_MEMORY_BUFFER, DeviceMemoryBuffer):
        parallel_state._GLOBAL_MEMORY_BUFFER = DeviceMemoryBuffer(device)
