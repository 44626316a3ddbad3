"""The interface every in-process training backend implements; `rlkube.core.trainer.Trainer` drives it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rlkube.core.batch import Batch
from rlkube.core.losses import LossStats


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
        """(model state_dict, optimizer state_dict) for a checkpoint."""
        ...
