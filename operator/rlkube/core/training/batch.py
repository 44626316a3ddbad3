"""Training documents -> padded tensors for one forward pass (pure, no I/O).

Token t is predicted from position t-1, so every per-token array here has T-1 columns: column j describes the
prediction of token j+1. A document's loss mask (spans EXCLUDED, Fast-LLM semantics) and its sampling
log-probs are shifted the same way; padding never counts in the loss.

Micro-batches are cut by a token budget (`spec.trainer.microBatchTokens`, counted as rows x padded length, which is
what a forward pass costs): `plan_micro_batches` sorts a step's documents by length so that similar lengths share a
micro-batch (little padding), and a document longer than the budget gets a micro-batch of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlkube.contract.protocol import Document


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64, right-padded
    loss_mask: torch.Tensor  # [B, T-1] bool: prediction of token j+1 counts in the loss
    old_logprobs: torch.Tensor  # [B, T-1] float32: sampling log-prob of token j+1 (0 where unknown)
    has_old_logprobs: torch.Tensor  # [B] bool: the document carried old_log_probabilities
    advantages: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [B] float32
    min_version: torch.Tensor  # [B] int64: oldest policy version among the document's loss tokens (-1: unknown)

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def split_by_tokens(self, budget: int) -> list[Batch]:
        """Row slices of at most `budget` tokens (rows x this batch's padded length; at least one row each)."""
        return self.split(max(1, budget // max(int(self.tokens.shape[1]), 1)))

    def split(self, micro_batch_size: int) -> list[Batch]:
        if micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1")
        out = []
        for start in range(0, self.size, micro_batch_size):
            sl = slice(start, start + micro_batch_size)
            out.append(
                Batch(
                    self.tokens[sl], self.loss_mask[sl], self.old_logprobs[sl], self.has_old_logprobs[sl],
                    self.advantages[sl], self.rewards[sl], self.min_version[sl],
                )
            )
        return out


def plan_micro_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of the documents of each micro-batch: longest first, each micro-batch as many documents as keep
    rows x its longest length within `budget` (a longer document alone)."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plans: list[list[int]] = []
    for i in order:
        # Longest first: the first document of a micro-batch sets its padded length.
        if plans and (len(plans[-1]) + 1) * lengths[plans[-1][0]] <= budget:
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


def collate(docs: Sequence[Document], pad_id: int = 0, max_length: int | None = None) -> Batch:
    """Pad documents into one Batch. A document longer than `max_length` raises (it names the length)."""
    if not docs:
        raise ValueError("cannot collate an empty list of documents")
    lengths = [len(d.tokens) for d in docs]
    if min(lengths) < 2:
        raise ValueError("a training document needs at least 2 tokens (one to predict from, one to predict)")
    length = max(lengths)
    if max_length is not None and length > max_length:
        raise ValueError(f"document of {length} tokens exceeds the model's maxSequenceLength {max_length}")
    b = len(docs)
    tokens = np.full((b, length), pad_id, dtype=np.int64)
    mask = np.zeros((b, length - 1), dtype=bool)
    old = np.zeros((b, length - 1), dtype=np.float32)
    has_old = np.zeros(b, dtype=bool)
    min_version = np.full(b, -1, dtype=np.int64)
    for i, doc in enumerate(docs):
        n = len(doc.tokens)
        tokens[i, :n] = doc.tokens
        doc_mask = doc.loss_mask()[1:]
        mask[i, : n - 1] = doc_mask
        if doc.old_log_probabilities is not None:
            old[i, : n - 1] = doc.old_log_probabilities[1:]
            has_old[i] = True
        if doc.model_version is not None and doc_mask.any():
            min_version[i] = int(doc.model_version[1:][doc_mask].min())
    return Batch(
        tokens=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(mask),
        old_logprobs=torch.from_numpy(old),
        has_old_logprobs=torch.from_numpy(has_old),
        advantages=torch.tensor([d.advantage for d in docs], dtype=torch.float32),
        rewards=torch.tensor([d.reward for d in docs], dtype=torch.float32),
        min_version=torch.from_numpy(min_version),
    )
