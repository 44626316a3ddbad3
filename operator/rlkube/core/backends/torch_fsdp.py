"""The `torch` backend with `spec.trainer.sharding: fsdp`: parameters, gradients and Adam state sharded over all
trainer ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`), so that a model whose fp32 masters and Adam state
do not fit one device fits the ranks together. Runs over gloo on CPU and NCCL on GPUs.

Layout: every decoder layer is its own FSDP unit (all-gathered just before its forward, freed after); the root unit
holds the rest (embeddings, final norm, LM head; a tied embedding is one parameter in one unit). The logits, and
the loss's chunked log-probs (`TorchBackend.token_logprobs`), are computed by methods registered as FSDP forward
methods, so the root unit is gathered for them exactly as for `model.forward` (and, as their outputs' gradients
arrive, for the backward in which the chunks' LM head is recomputed), while the decoder runs in the compute dtype
and the LM head in float32 as in `TorchBackend`.

Precision: with `spec.model.dtype: bfloat16` the layer units all-gather their float32 shards cast to bfloat16 and
reduce-scatter gradients in float32 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); the root unit
stays float32 (the LM head and log-softmax in float32, as the single-process backend does). Adam updates the
float32 sharded masters.

Gradient division: FSDP2 divides the reduce-scattered gradient by the world size by default (the mean over data-
parallel ranks, DDP's convention). Our loss is already divided by the step's GLOBAL loss-token count on every
rank (the trainer sums the counts first), so the single-process gradient of the union of the documents is the
SUM over ranks: `set_gradient_divide_factor(1.0)` on every FSDP unit (the setter is not recursive in torch 2.13)
with `set_force_sum_reduction_for_comms(True)` makes the reduce-scatter a plain ReduceOp.SUM with no division
(without the latter FSDP2 sends ReduceOp.PREMUL_SUM(1.0), which gloo does not implement). Every micro-batch
reduce-scatters into the sharded gradient (gradients stay sharded; no unsharded accumulation buffers), so every
rank must run the same number of forward/backward passes: the trainer pads a rank with fewer micro-batches with
`forward_backward_nothing` (a pass with zero gradient).

Every method that touches whole tensors is a COLLECTIVE (all ranks call it, in the same order): `weights()` yields
on every rank, one parameter all-gathered at a time (the backend never holds more than one full tensor);
`weight_stream()` is what weight publishing uses: the update of rlkube.core.weights streamed bucket by bucket
(every rank gathers one bucket's parameters, rank 0 casts them into the bucket's buffer and sends it, then the next),
so rank 0 holds one bucket and one full tensor at a time, never the whole model; `full_state()` gathers a
CPU copy on rank 0 only (the Hugging Face export), `save_distributed` / `load_distributed` write and read each
rank's shards with torch.distributed.checkpoint (resumable at a different world size).

LoRA (spec.trainer.lora, rlkube.core.backends.fsdp_lora): PEFT wraps the model before `fully_shard` and rank 0's
adapter is broadcast first; Adam and clipping cover the adapter's shards only. `weights()` and the full
`weight_stream` are the merged weights under the HF names (for vLLM), `weight_stream(adapter=True)` and
`adapter_update()` the adapter alone (the native engine's update), `full_state()` the gathered adapter (rank 0 writes
PEFT's adapter directory from it), and the distributed checkpoint holds the adapter and its Adam state only (the
frozen base is the job's model directory, loaded by every rank).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from rlkube.api.spec import TrainingJobSpec
from rlkube.core.training import lora as lora_mod
from rlkube.core.backends import fsdp_lora
from rlkube.core.backends.base import lr_scheduler
from rlkube.core.backends.torch_backend import TorchBackend, model_logits, model_logprobs
from rlkube.core.training.losses import LossStats
from rlkube.core.weights.wire import AdapterUpdate, StreamedWeights, combine_sums, dtype_name

SCHEDULER_FILE = "scheduler.pt"


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers decoder (LlamaModel.layers and the like)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder `layers` to shard with FSDP")
    return list(layers)


class FSDPTorchBackend(TorchBackend):
    shards_gradients = True  # the trainer must not all-reduce gradients itself

    def __init__(self, spec: TrainingJobSpec, model_dir: Path, device: str = "cpu"):
        if not dist.is_initialized():
            raise RuntimeError("spec.trainer.sharding 'fsdp' needs the trainer's process group (torch.distributed)")
        # Every rank loads the same full model from the job's directory, then keeps only its shards.
        super().__init__(spec, model_dir, device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if self.lora is not None:
            fsdp_lora.broadcast_adapter(self.model)  # before sharding (rlkube.core.backends.fsdp_lora)
        if self.compute_dtype == torch.float32:
            layer_policy = MixedPrecisionPolicy()
        else:
            layer_policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        # cpuOffload: shards, gradients and Adam state in host memory, the optimizer step on the CPU; pinned
        # memory (faster copies) needs CUDA. On a CPU-only trainer nothing moves, the same code path runs.
        offload = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if spec.trainer.cpu_offload
                   else OffloadPolicy())
        # The mesh on the trainer's device type: FSDP2's default mesh is on the machine's accelerator whenever
        # one is visible, which would move a CPU (gloo) trainer's shards onto a GPU it was not given.
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        for layer in decoder_layers(self.model):
            fully_shard(layer, mesh=mesh, mp_policy=layer_policy, offload_policy=offload)
        fully_shard(self.model, mesh=mesh, mp_policy=MixedPrecisionPolicy(), offload_policy=offload)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)  # a SUM over ranks (module docstring)
                # and a plain ReduceOp.SUM on the wire: with a factor set FSDP2 would otherwise use
                # ReduceOp.PREMUL_SUM(1/factor), which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
                module.set_force_sum_reduction_for_comms(True)
        autocast = self._autocast
        self.model.rlkube_logits = types.MethodType(lambda m, tokens: model_logits(m, tokens, autocast), self.model)
        register_fsdp_forward_method(self.model, "rlkube_logits")
        self.model.rlkube_logprobs = types.MethodType(
            lambda m, tokens: model_logprobs(m, tokens, autocast, self.temperature, self.loss_chunk_tokens),
            self.model)
        register_fsdp_forward_method(self.model, "rlkube_logprobs")
        # Adam over the sharded (DTensor) parameters: its state is sharded like them (with LoRA: the adapter's).
        algo = spec.algorithm
        self.optimizer = torch.optim.Adam(self.gradient_parameters(), lr=algo.learning_rate)
        self.scheduler = lr_scheduler(self.optimizer, algo.lr_schedule, algo.warmup_steps, algo.max_steps)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.rlkube_logits(tokens)

    def token_logprobs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.rlkube_logprobs(tokens)

    def forward_backward_nothing(self) -> LossStats:
        """A forward/backward pass that adds nothing to the gradients, for a rank with fewer micro-batches than
        its peers (FSDP's all-gathers and reduce-scatters are collectives: every rank runs as many passes)."""
        tokens = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        (self.token_logprobs(tokens)[0].sum() * 0.0).backward()
        return LossStats()

    def optim_step(self) -> float:
        # clip_grad_norm_ on DTensor gradients computes the global norm (an all-reduce) and clips every shard.
        norm = torch.nn.utils.clip_grad_norm_(self.gradient_parameters(), self.grad_clip_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    # --- whole tensors (collectives) ---

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """COLLECTIVE, on every rank: (HF name, full float32 tensor), one parameter gathered at a time; ranks
        other than 0 just drain it (`for _ in backend.weights(): pass`). With LoRA: base + adapter merged."""
        if self.lora is not None:
            merged = fsdp_lora.MergedWeights(self.model, self._hf_names)
            for name in merged.names:
                yield name, merged.full(name)
            return
        for name, tensor in self.model.state_dict().items():
            if name in self._aliases:
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.detach()

    def _stream_sources(self, adapter: bool) -> list[tuple[str, torch.Tensor, Any, Any]]:
        """What a weight stream sends: (name, the sharded tensor giving its shape and dtype, this rank's share of
        its values, its full value), the last two callables (collectives)."""
        if self.lora is not None and adapter:
            named = list(lora_mod.adapter_state(self.model).items())
        elif self.lora is None:
            named = [(n, t.detach()) for n, t in self.model.state_dict().items() if n not in self._aliases]
        else:
            merged = fsdp_lora.MergedWeights(self.model, self._hf_names)
            return [(n, merged.reference(n), lambda n=n: merged.local(n), lambda n=n: merged.full(n))
                    for n in merged.names]
        return [(n, t, lambda t=t: fsdp_lora.local(t), lambda t=t: fsdp_lora.full(t)) for n, t in named]

    def weight_stream(self, dtype: torch.dtype | None, bucket_bytes: int, device: str | torch.device | None = None,
                      rendezvous=None, adapter: bool = False) -> StreamedWeights:
        """COLLECTIVE, on every rank: the weights as an update streamed bucket by bucket (rlkube.core.weights:
        rank 0 sends, the others drain), in transfer dtype `dtype` (None: each tensor's own) with `weights()`'s
        names and order (`adapter`, with LoRA: the adapter alone, an update of kind lora-adapter). Shapes come from
        the sharded parameters and the checksum from the shards' sums (one all-reduce), so nothing is gathered
        before the first bucket."""
        sources = self._stream_sources(adapter)
        specs, sums = [], []
        for name, t, local_values, _ in sources:
            out = dtype if dtype is not None and t.is_floating_point() else t.dtype
            specs.append([name, list(t.shape), dtype_name(out)])
            if isinstance(t, DTensor):
                sums.append(local_values().to(out).sum(dtype=torch.float64))
            else:  # replicated on every rank: counted once
                sums.append(t.to(out).sum(dtype=torch.float64) if self.rank == 0
                            else torch.zeros((), dtype=torch.float64, device=t.device))
        totals = torch.stack(sums).to(self.device) if sums else torch.zeros(0, dtype=torch.float64)
        dist.all_reduce(totals)
        checksum = combine_sums(zip((s[0] for s in sources), totals.tolist(), strict=True))

        def gather(indices):
            for i in indices:
                yield sources[i][3]()

        def agree(flag: bool) -> bool:
            box = torch.tensor([1.0 if flag and self.rank == 0 else 0.0], device=self.device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            return bool(box.item())

        return StreamedWeights(specs, checksum, gather, agree, bucket_bytes,
                               device=self.device if device is None else device, rendezvous=rendezvous,
                               adapter=lora_mod.wire_config(self.lora) if adapter and self.lora else None)

    def adapter_update(self) -> AdapterUpdate:
        """COLLECTIVE (LoRA): the adapter, gathered whole on every rank, as a weight update."""
        if self.lora is None:
            raise RuntimeError("adapter_update() without spec.trainer.lora")
        return AdapterUpdate(list(fsdp_lora.adapter_full(self.model).items()), lora_mod.wire_config(self.lora))

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """COLLECTIVE: (full model state on CPU under HF names on rank 0, {} elsewhere; LR schedule state). The
        optimizer state is not gathered: it lives in the distributed checkpoint. With LoRA: the adapter's tensors
        under PEFT's names."""
        if self.lora is not None:
            adapter = fsdp_lora.adapter_full(self.model)
            state = {k: v.detach().cpu().clone() for k, v in adapter.items()} if self.rank == 0 else {}
            return state, {"scheduler": self.scheduler.state_dict(), "distributed": True}
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        # clone: a gathered tensor can be a view into a larger buffer, which safetensors refuses to save
        state = {k: v.clone() for k, v in state.items() if k not in self._aliases}
        return state, {"scheduler": self.scheduler.state_dict(), "distributed": True}

    def state(self):
        raise NotImplementedError("sharded backend: use full_state() (collective) and save_distributed()")

    def load_state(self, model_state, optimizer_state) -> None:
        raise NotImplementedError("sharded backend: use load_distributed()")

    def save_distributed(self, directory: Path) -> None:
        """COLLECTIVE: each rank writes its shards of the weights and of Adam's state (torch.distributed.checkpoint
        into `directory`, which every rank must see: a shared volume); rank 0 also the LR schedule."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))
        if self.rank == 0:
            torch.save(self.scheduler.state_dict(), Path(directory) / SCHEDULER_FILE)
        dist.barrier()

    def load_distributed(self, directory: Path) -> None:
        """COLLECTIVE: the inverse of `save_distributed`, at any world size (DCP reshards on load)."""
        options = self._dcp_options()
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(directory))  # raises on a key the checkpoint lacks
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        self.scheduler.load_state_dict(torch.load(Path(directory) / SCHEDULER_FILE, weights_only=True))

    def _dcp_options(self) -> StateDictOptions:
        """LoRA: the distributed checkpoint holds the adapter only (the frozen base is the job's model directory);
        loading is then not strict about the base's keys, while dcp.load still refuses a missing adapter key."""
        if self.lora is None:
            return StateDictOptions()
        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def local_bytes(self) -> dict[str, int]:
        """This rank's parameter and Adam-state bytes (its shards), for memory accounting."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        params = sum(local(p).numel() * local(p).element_size() for p in self.model.parameters())
        optim = sum(local(v).numel() * local(v).element_size() for s in self.optimizer.state.values()
                    for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"parameters": params, "optimizer": optim}

