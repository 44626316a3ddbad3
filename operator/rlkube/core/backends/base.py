"""The interface every in-process training backend implements (`rlkube.core.trainer.Trainer` drives it), and the
loss step they share, so that every backend optimises exactly the same objective from its logits.

The contract a backend keeps (the torch backend is the reference; the megatron backend maps to it):

- Construction: `Backend(spec, model_dir, device)`. `model_dir` is the job's Hugging Face model directory, already
  materialized and checked (`rlkube.core.hf.source.materialize_model(spec.model)`): config.json, safetensors
  weights, tokenizer files. The backend loads its initial weights from it, under the HF names.
- Names and layout: `weights()` and `state()` speak Hugging Face: exactly the names, shapes and layouts of the
  directory's safetensors (what `AutoModelForCausalLM.state_dict()` has), each tied weight ONCE under the first
  name the state_dict has for it (`model.embed_tokens.weight` for tied embeddings; see rlkube.core.hf.state).
  A backend that keeps its weights differently (megatron's fused QKV / gate-up, its own names) converts in these
  two methods and back in `load_state`. Checkpoints (the HF directory plus optimizer state) and the weight
  transfer to inference are built from them, so they are interchangeable between backends and loadable by
  transformers and vLLM.
- Precision: `weights()`/`state()` give the master weights (float32); the weight publisher casts to the
  transfer dtype (`spec.trainer.weightTransfer.dtype`). Compute may be bfloat16 (`spec.model.dtype`), but the
  optimizer updates float32 masters, so updates smaller than bfloat16's resolution still accumulate.
- `forward_backward(batch, normalizer)` ACCUMULATES gradients of `loss / normalizer` (never zeroes them) and
  returns the micro-batch's loss statistics (use `logprob_loss` below on log-probs taken from the final hidden
  states chunk by chunk, `losses.chunked_token_logprobs`, so that no [tokens, vocabulary] tensor is ever whole;
  `batch_loss` on full float32 logits is the same loss). `batch.tokens` are
  right-padded; the loss mask excludes the padding, so no attention mask is needed (causal attention never looks
  right).
- `optim_step()` clips the gradient norm to `spec.algorithm.gradClipNorm`, steps the optimizer and the learning
  rate schedule (`spec.algorithm.lrSchedule`, `warmupSteps`), then zeroes the gradients; returns the norm
  before clipping. `learning_rate` is the rate the next `optim_step` applies.
- `gradient_parameters()` are the parameters whose `.grad` holds the gradient accumulated since the last
  `optim_step` (what the data-parallel path sums over ranks before `optim_step`): the model's parameters for the
  torch backend, the float32 masters for the megatron backend in bfloat16.
- `state()` -> (model state as `weights()` gives it, float32; optimizer state: any dict that `torch.save` and
  `torch.load(weights_only=True)` round-trip, including the LR schedule). `load_state(model_state,
  optimizer_state or None)` is its inverse, strict: a missing or unexpected name raises. The optimizer state is
  backend-specific: the trainer only hands it back to the backend that wrote it (meta.json names the backend).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rlkube.api.spec import AlgorithmSpec
from rlkube.core.training.batch import Batch
from rlkube.core.training.losses import (
    LossConfig,
    LossOutput,
    LossStats,
    OffPolicyConfig,
    policy_loss,
    token_entropy,
    token_logprobs,
)


class TrainerBackend(Protocol):
    model: torch.nn.Module
    pad_id: int
    max_sequence_length: int
    # What the Trainer must do differently for this backend, declared by each backend rather than probed:
    shards_gradients: bool
    """The model is sharded over the ranks (FSDP): the backend reduces gradients itself, and whole-model
    operations (weights, state, checkpoints) are collectives of every rank."""
    collective_weights: bool
    """weights() and state() are collectives of every rank (megatron with tensor parallelism)."""
    parallel_layout: Any
    """The backend's model-parallel groups (megatron_backend.ParallelLayout), or None: the data-parallel sum of
    gradients runs over the replicas it names instead of over every rank."""

    @property
    def learning_rate(self) -> float:
        """The learning rate the next optim_step applies (after warm-up and schedule)."""
        ...

    def gradient_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters whose `.grad` holds the accumulated gradient (see the module docstring)."""
        ...

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        """Loss of `batch` divided by `normalizer`; ACCUMULATES gradients (never zeroes them)."""
        ...

    def optim_step(self) -> float:
        """Clip, step the optimizer and the LR schedule, then zero the gradients; returns the norm before clipping."""
        ...

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of every weight, master precision, each tied weight once (see the module docstring)."""
        ...

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(model state under HF names, float32; optimizer + LR schedule state) for a checkpoint."""
        ...

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        """Inverse of `state` (strict: a missing or unexpected parameter raises)."""
        ...


def loss_config(algo: AlgorithmSpec) -> LossConfig:
    """The loss of `spec.algorithm` (every in-process backend builds it the same way)."""
    corr = algo.off_policy_correction
    return LossConfig(algo.loss, algo.clip_epsilon_low, algo.clip_epsilon_high,
                      off_policy=OffPolicyConfig(corr.mode, corr.level, corr.cap, corr.lower), kl_coef=algo.kl_coef)


def batch_loss(logits: torch.Tensor, batch: Batch, config: LossConfig, temperature: float,
               normalizer: float, ref_logprobs: torch.Tensor | None = None) -> LossOutput:
    """The policy loss of a micro-batch from the model's full logits [B, T, V] (call `.loss.backward()`). The
    backends use `logprob_loss` on chunked log-probs (`losses.chunked_token_logprobs`); this is the reference.
    `ref_logprobs` [B, T-1]: the reference policy's log-probs of the tokens, for config.kl_coef > 0."""
    new_logp = token_logprobs(logits, batch.tokens.to(logits.device), temperature)
    return logprob_loss(new_logp, token_entropy(logits[:, :-1]), batch, config, normalizer, ref_logprobs)


def logprob_loss(new_logp: torch.Tensor, entropy: torch.Tensor | None, batch: Batch, config: LossConfig,
                 normalizer: float, ref_logprobs: torch.Tensor | None = None) -> LossOutput:
    """The policy loss of a micro-batch from the current policy's log-probs of tokens 1.. [B, T-1] (with gradient)
    and the entropy at those positions (statistics only); `ref_logprobs` as in `batch_loss`."""
    device = new_logp.device
    # A document without sampling log-probs (e.g. SFT data) is treated as on-policy: ratio 1.
    old = torch.where(batch.has_old_logprobs.to(device)[:, None], batch.old_logprobs.to(device), new_logp.detach())
    return policy_loss(new_logp, old, batch.advantages.to(device), batch.loss_mask.to(device), config,
                       normalizer=normalizer, entropy=entropy, ref_logp=ref_logprobs)


def lr_scheduler(optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, max_steps: int):
    """transformers' schedule of that name (constant/cosine/linear, with linear warm-up from 0), stepped once per
    optimizer step; cosine and linear reach 0 at maxSteps."""
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}[schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=max_steps)
