"""The `megatron` backend: the job's Hugging Face model as a megatron-core GPTModel behind the Trainer API.

`spec.trainer.backend: megatron` (image trainer-megatron, extra `rlkube[megatron]`) trains a megatron-core (0.16.1)
`GPTModel` built from megatron's local layer spec with the architecture of the job's Hugging Face directory
(`megatron_gpt`, `megatron_hf`), on CPU through the shim in `megatron_cpu` or on a GPU (one per rank). It keeps the contract of
`base.py`: the same losses (`base.logprob_loss`, on log-probs chunked over the tokens and vocabulary-parallel:
`MegatronGPT.token_logprobs`), Adam with gradient clipping and the same LR schedule, and weights
and checkpoints under Hugging Face names and layouts (megatron's fused QKV and gate/up are split at the edge), so
inference servers receive what they loaded from the directory and a checkpoint loads in transformers and vLLM.

Precision, as megatron trains in bfloat16 (its Float16Module + a float32 copy in the optimizer): with
`spec.model.dtype: bfloat16` the GPTModel's parameters are bfloat16 (the compute), and the backend keeps float32
master weights that Adam updates; each backward's bfloat16 gradients are added into the masters' float32 gradients
(megatron's `main_grad`), and the masters are copied into the model after each step. The LM head multiplies in
float32 (`megatron_gpt`). With float32 the model's parameters are the masters.

Parallelism (`spec.trainer.megatron.tensorParallel` = TP over the trainer's ranks; data parallel DP = ranks / TP):
megatron-core's `parallel_state.initialize_model_parallel` builds the tensor- and data-parallel groups over the
trainer's process group (gloo on CPU, NCCL on GPUs; ranks r*TP .. r*TP+TP-1 form data-parallel rank r's
tensor-parallel group, megatron's order). The GPTModel's column/row-parallel layers hold each rank's shards and do
their own all-reduces; every tensor-parallel rank computes the loss of the same micro-batch from its vocabulary
shard of the logits (the log-softmax's maximum and sums all-reduced, `MegatronGPT.token_logprobs`). The gradients
are then summed over the DATA-parallel group by the Trainer (`parallel_layout` tells it the groups;
`gradient_parameters` are this rank's masters, so shards are summed with the same shards), with the loss normalised
by the step's global token count: a step equals single-process training on the union of the data-parallel ranks'
documents, as for the torch backend. The gradient norm adds the squares of the shards over the tensor-parallel group
(replicated norms counted once). Weights, checkpoints and Adam state are gathered to the tensor parallel 1 layout
(`MegatronGPT.gather`), so they are the same at any TP and a checkpoint resumes at another. Everything that gathers
is a COLLECTIVE with TP > 1 (`collective_weights`): every rank calls `weights()`, `state()` in the same order.

Not used: megatron's DistributedDataParallel and distributed optimizer (their gradient buffers are allocated on
`torch.cuda.current_device()`, so they cannot run on CPU), pipeline parallelism and sequence parallelism.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract.runtime import ENV_COLLECTIVE_TIMEOUT
from rlkube.core.training import checkpoint as ckpt
from rlkube.core.backends.base import logprob_loss, loss_config, lr_scheduler
from rlkube.core.backends.megatron_gpt import MegatronGPT
from rlkube.core.backends.megatron_hf import Architecture, UnsupportedArchitecture, tp_dim
from rlkube.core.backends.torch_distributed import DEFAULT_COLLECTIVE_TIMEOUT_S
from rlkube.core.training.batch import Batch
from rlkube.core.hf.errors import ModelError
from rlkube.core.hf.loading import DTYPES, FIELD, check_sequence_length, load_config, load_tokenizer
from rlkube.core.training.losses import DEFAULT_LOSS_CHUNK_TOKENS, LossStats

log = logging.getLogger("rlkube.trainer.megatron")

TP_FIELD = "spec.trainer.megatron.tensorParallel"
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # per-parameter tensors of the parameter's shape


@dataclass(frozen=True)
class ParallelLayout:
    """Where this rank sits in megatron's process groups (what the trainer's data-parallel path needs)."""

    tensor_parallel: int
    tensor_rank: int
    tensor_group: Any
    tensor_source: int  # global rank of tensor-parallel rank 0 of this rank's group (it reads the documents)
    data_parallel: int
    data_rank: int
    data_group: Any


def check_tensor_parallel(config: Any, tp: int) -> None:
    """TP must split the attention heads, key/value groups, MLP and vocabulary evenly (megatron's requirement)."""
    if tp == 1:
        return
    arch = Architecture.of(config)
    sizes = {"attention heads": arch.heads, "key/value heads": arch.kv_heads,
             "intermediate size": config.intermediate_size, "vocabulary size": config.vocab_size}
    bad = {what: n for what, n in sizes.items() if n % tp}
    if bad:
        raise ModelError(TP_FIELD, f"{tp} does not divide the model's " +
                         ", ".join(f"{what} ({n})" for what, n in bad.items()))


def collective_timeout_s() -> float:
    """The trainer's collective timeout (RLKUBE_COLLECTIVE_TIMEOUT_S, checked by DistConfig), for megatron's groups."""
    return float(os.environ.get(ENV_COLLECTIVE_TIMEOUT) or DEFAULT_COLLECTIVE_TIMEOUT_S)


def parallel_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    return ParallelLayout(
        tensor_parallel=ps.get_tensor_model_parallel_world_size(), tensor_rank=ps.get_tensor_model_parallel_rank(),
        tensor_group=tp_group, tensor_source=dist.get_global_rank(tp_group, 0),
        data_parallel=ps.get_data_parallel_world_size(), data_rank=ps.get_data_parallel_rank(),
        data_group=ps.get_data_parallel_group())


class MegatronBackend:
    loss_chunk_tokens = DEFAULT_LOSS_CHUNK_TOKENS  # tokens per chunk of the output layer + log-softmax in the loss
    shards_gradients = False  # (declared capabilities; collective_weights and parallel_layout are set per instance)

    def __init__(self, spec: TrainingJobSpec, model_dir: Path, device: str = "cpu"):
        algo = spec.algorithm
        if spec.model.dtype == "float16":
            # float16 gradients underflow without loss scaling, which this backend does not do (as the torch one)
            raise ModelError("spec.model.dtype", "the megatron backend trains in float32 or bfloat16 (float16 needs "
                                                 "loss scaling); use bfloat16")
        self.device = torch.device(device)
        config = load_config(model_dir)
        self.pad_id = load_tokenizer(model_dir, config).pad_id
        check_sequence_length(config, spec.model.max_sequence_length)
        self.max_sequence_length = spec.model.max_sequence_length
        self.compute_dtype = DTYPES[spec.model.dtype]
        tp = spec.trainer.megatron.tensor_parallel
        try:
            check_tensor_parallel(config, tp)
            self.gpt = MegatronGPT(config, self.compute_dtype, self.device, seed=spec.model.seed,
                                   recompute=spec.trainer.gradient_checkpointing, tensor_parallel=tp,
                                   timeout_s=collective_timeout_s())
        except UnsupportedArchitecture as exc:
            raise ModelError(FIELD, f"the megatron backend cannot train {model_dir}: {exc}") from None
        self.tensor_parallel = tp
        self.collective_weights = tp > 1  # weights() and state() gather over the tensor-parallel group
        self.parallel_layout = layout = parallel_layout()
        log.info("megatron-core: tensor parallel %d x data parallel %d; this rank is tensor rank %d of data rank %d",
                 layout.tensor_parallel, layout.data_parallel, layout.tensor_rank, layout.data_rank)
        self.model = self.gpt.model
        self.model.train()
        params = dict(self.model.named_parameters())
        # the gradient norm counts a replicated parameter (a norm) once over the tensor-parallel ranks
        self._in_norm = {n: tp_dim(n) is not None or self.gpt.tp_rank == 0 for n in params}
        if self.compute_dtype == torch.float32:
            self.masters = params  # the model's own parameters are the float32 weights Adam updates
        else:
            self.masters = {n: torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device=self.device))
                            for n, p in params.items()}
        self.load_state(ckpt.load_weights(model_dir), None)  # the directory's safetensors, under HF names
        self.optimizer = torch.optim.Adam(self.masters.values(), lr=algo.learning_rate)
        self.scheduler = lr_scheduler(self.optimizer, algo.lr_schedule, algo.warmup_steps, algo.max_steps)
        self.loss_config = loss_config(algo)  # klCoef > 0 is refused for megatron (lifecycle.validation)
        self.temperature = algo.temperature
        self.grad_clip_norm = algo.grad_clip_norm

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def gradient_parameters(self) -> Iterable[torch.nn.Parameter]:
        return self.masters.values()  # the model's own parameters in float32

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt.logits(tokens)

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        new_logp, entropy = self.gpt.token_logprobs(batch.tokens, self.temperature, self.loss_chunk_tokens)
        out = logprob_loss(new_logp, entropy, batch, self.loss_config, normalizer)
        out.loss.backward()
        if self.compute_dtype != torch.float32:
            # megatron's main_grad: low-precision gradients accumulate in float32 across micro-batches
            for name, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                master = self.masters[name]
                grad = p.grad.float()
                master.grad = grad if master.grad is None else master.grad.add_(grad)
                p.grad = None
        return out.stats

    def _tensor_parallel_grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient: the squares of this rank's shards summed over the
        tensor-parallel group (a replicated parameter, a norm, counted on tensor-parallel rank 0 only)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for name, m in self.masters.items():
            if m.grad is not None and self._in_norm[name]:
                squares = squares + torch.linalg.vector_norm(m.grad) ** 2
        dist.all_reduce(squares, group=self.gpt.tp_group)
        return squares.sqrt()

    def optim_step(self) -> float:
        if self.tensor_parallel == 1:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.masters.values(), self.grad_clip_norm)
        else:
            grad_norm = self._tensor_parallel_grad_norm()
            # what clip_grad_norm_ does with that norm: scale by min(1, max_norm / (norm + 1e-6))
            torch.nn.utils.clip_grads_with_norm_(self.masters.values(), self.grad_clip_norm, grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # AFTER the step: gradients accumulate until here
        if self.compute_dtype != torch.float32:
            self._copy_masters_to_model()
        return float(grad_norm)

    def _copy_masters_to_model(self) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.masters[name])

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Hugging Face names and layouts of the float32 master weights (a tied embedding once). With tensor
        parallelism a COLLECTIVE iterator: one parameter gathered at a time, on every rank (the others drain it)."""
        if self.tensor_parallel == 1:
            return list(self.gpt.to_hf_names({n: m.detach() for n, m in self.masters.items()}).items())
        return self._gathered_weights()

    def _gathered_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, master in self.masters.items():
            yield from self.gpt.to_hf_names({name: self.gpt.gather(name, master.detach())}).items()

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(weights under HF names, {Adam state in the tensor parallel 1 layout, LR schedule}); a collective with
        tensor parallelism. Adam's state is keyed by parameter index as torch's, in megatron's parameter order."""
        optimizer = self.optimizer.state_dict()
        names = list(self.masters)
        optimizer["state"] = {i: {k: self.gpt.gather(names[i], v) if k in ADAM_MOMENTS else v for k, v in s.items()}
                              for i, s in optimizer["state"].items()}
        return dict(self.weights()), {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        values = self.gpt.to_megatron_names(model_state)  # strict: a missing or unexpected name raises
        with torch.no_grad():
            for name, value in values.items():
                master = self.masters[name]
                if master.shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} != the model's {tuple(master.shape)}")
                master.copy_(value)
        if self.compute_dtype != torch.float32:
            self._copy_masters_to_model()
        if optimizer_state is not None:
            names = list(self.masters)
            optimizer = dict(optimizer_state["optimizer"])
            optimizer["state"] = {i: {k: self.gpt.shard(names[int(i)], v) if k in ADAM_MOMENTS else v
                                      for k, v in s.items()} for i, s in optimizer["state"].items()}
            self.optimizer.load_state_dict(optimizer)
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
