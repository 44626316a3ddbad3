"""The interface every in-process training backend implements (`rlkube.core.trainer.Trainer` drives it), and
the loss step they share, so that every backend optimises exactly the same objective from its logits."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rlkube.core.batch import Batch
from rlkube.core.losses import (
    LossConfig,
    LossOutput,
    LossStats,
    policy_loss,
    token_entropy,
)
from rlkube.core.model import token_logprobs


class TrainerBackend(Protocol):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_id: int
    max_sequence_length: int

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        """Loss of `batch` divided by `normalizer`; ACCUMULATES gradients (never zeroes them)."""
        ...

    def optim_step(self) -> float:
        """Clip, step, then zero the gradients; returns the gradient norm before clipping."""
        ...

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight, in the order the inference side expects (its state_dict's)."""
        ...

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(model state_dict, optimizer state_dict) for a checkpoint, in TinyLM's names, layout and parameter
        order whatever the backend, so checkpoints are interchangeable and servable."""
        ...

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        """Inverse of `state` (strict: a missing or unexpected parameter raises)."""
        ...


def batch_loss(logits: torch.Tensor, batch: Batch, config: LossConfig, temperature: float,
               normalizer: float) -> LossOutput:
    """The policy loss of a micro-batch from the model's logits [B, T, V] (call `.loss.backward()`)."""
    device = logits.device
    tokens = batch.tokens.to(device)
    new_logp = token_logprobs(logits, tokens, temperature)
    # A document without sampling log-probs (e.g. SFT data) is treated as on-policy: ratio 1.
    old = torch.where(batch.has_old_logprobs.to(device)[:, None], batch.old_logprobs.to(device), new_logp.detach())
    return policy_loss(new_logp, old, batch.advantages.to(device), batch.loss_mask.to(device), config,
                       normalizer=normalizer, entropy=token_entropy(logits[:, :-1]))
