"""The `megatron` backend: the job's Hugging Face model as a megatron-core GPTModel behind the Trainer API.

`spec.trainer.backend: megatron` (image trainer-megatron, extra `rlkube[megatron]`) trains a megatron-core (0.16.1)
`GPTModel` built from megatron's local layer spec with the architecture of the job's Hugging Face directory
(`megatron_gpt`, `megatron_hf`), on CPU through the shim in `megatron_cpu` or on a GPU (one per rank). It keeps the contract of
`base.py`: the same losses (`base.batch_loss`), Adam with gradient clipping and the same LR schedule, and weights
and checkpoints under Hugging Face names and layouts (megatron's fused QKV and gate/up are split at the edge), so
inference servers receive what they loaded from the directory and a checkpoint loads in transformers and vLLM.

Precision, as megatron trains in bfloat16 (its Float16Module + a float32 copy in the optimizer): with
`spec.model.dtype: bfloat16` the GPTModel's parameters are bfloat16 (the compute), and the backend keeps float32
master weights that Adam updates; each backward's bfloat16 gradients are added into the masters' float32 gradients
(megatron's `main_grad`), and the masters are copied into the model after each step. The LM head multiplies in
float32 (`megatron_gpt`). With float32 the model's parameters are the masters.

Tensor and pipeline parallel size 1; megatron's distributed optimizer and data-parallel wrappers are not used. With
several trainer ranks the Trainer's data-parallel path sums `gradient_parameters()` (the float32 masters'
gradients) over the ranks, as for the torch backend; tensor and pipeline parallelism are a later issue.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.core import checkpoint as ckpt
from rlkube.core.backends.base import batch_loss, lr_scheduler
from rlkube.core.backends.megatron_gpt import MegatronGPT
from rlkube.core.backends.megatron_hf import UnsupportedArchitecture
from rlkube.core.batch import Batch
from rlkube.core.hf.errors import ModelError
from rlkube.core.hf.loading import DTYPES, FIELD, check_sequence_length, load_config, load_tokenizer
from rlkube.core.losses import LossConfig, LossStats


class MegatronBackend:
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
        try:
            self.gpt = MegatronGPT(config, self.compute_dtype, self.device, seed=spec.model.seed,
                                   recompute=spec.trainer.gradient_checkpointing)
        except UnsupportedArchitecture as exc:
            raise ModelError(FIELD, f"the megatron backend cannot train {model_dir}: {exc}") from None
        self.model = self.gpt.model
        self.model.train()
        params = dict(self.model.named_parameters())
        if self.compute_dtype == torch.float32:
            self.masters = params  # the model's own parameters are the float32 weights Adam updates
        else:
            self.masters = {n: torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32, device=self.device))
                            for n, p in params.items()}
        self.load_state(ckpt.load_weights(model_dir), None)  # the directory's safetensors, under HF names
        self.optimizer = torch.optim.Adam(self.masters.values(), lr=algo.learning_rate)
        self.scheduler = lr_scheduler(self.optimizer, algo.lr_schedule, algo.warmup_steps, algo.max_steps)
        self.loss_config = LossConfig(algo.loss, algo.clip_epsilon_low, algo.clip_epsilon_high)
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
        out = batch_loss(self.logits(batch.tokens), batch, self.loss_config, self.temperature, normalizer)
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

    def optim_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.masters.values(), self.grad_clip_norm)
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
        """Hugging Face names and layouts of the float32 master weights (a tied embedding once)."""
        return list(self.gpt.to_hf_names({n: m.detach() for n, m in self.masters.items()}).items())

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return dict(self.weights()), {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

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
            self.optimizer.load_state_dict(optimizer_state["optimizer"])
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
