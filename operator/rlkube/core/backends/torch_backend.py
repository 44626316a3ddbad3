"""The `torch` backend: the built-in model trained with plain torch (CPU or one GPU), Adam, grad clipping."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.core.backends.base import batch_loss
from rlkube.core.batch import Batch
from rlkube.core.losses import LossConfig, LossStats
from rlkube.core.model import build_model, build_tokenizer


class TorchBackend:
    def __init__(self, spec: TrainingJobSpec, device: str = "cpu"):
        algo = spec.algorithm
        self.device = torch.device(device)
        tokenizer = build_tokenizer(spec.model)
        self.pad_id = tokenizer.pad_id
        self.model = build_model(spec.model, tokenizer.vocab_size).to(self.device)
        self.model.train()
        self.max_sequence_length = self.model.config.max_sequence_length
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=algo.learning_rate)
        self.loss_config = LossConfig(algo.loss, algo.clip_epsilon_low, algo.clip_epsilon_high)
        # The actors' sampling log-probs are of the temperature-scaled distribution; so are ours.
        self.temperature = algo.temperature
        self.grad_clip_norm = algo.grad_clip_norm

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        logits = self.model(batch.tokens.to(self.device))
        out = batch_loss(logits, batch, self.loss_config, self.temperature, normalizer)
        out.loss.backward()
        return out.stats

    def optim_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        # Zero AFTER the step (seed-systems 6.15: zeroing inside forward_backward broke accumulation).
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return list(self.model.state_dict().items())

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        self.model.load_state_dict(model_state, strict=True)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state)
