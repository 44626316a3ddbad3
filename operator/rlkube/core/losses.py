"""Policy losses over per-token log-probs (pure torch, no model, no I/O), shared by every torch-based backend.

All losses take, per predicted token: `new_logp` (current policy, with gradient), `old_logp` (the SAMPLING
log-prob the actor recorded, i.e. the behaviour policy; docs/references.md §6.15: the importance ratio is new/old, not
new/new-detached), the document's scalar `advantages` [B] broadcast to its tokens, and a boolean `mask`.

- grpo / ppo: token-level ratio r = exp(new - old), loss = -min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A).
  (With group-relative advantages and no critic the two are the same objective; both names are accepted.)
- gspo: sequence-level ratio s = exp(mean over the sequence's loss tokens of (new - old)), clipped the same way;
  the sequence's loss is counted once per loss token so that every loss is normalised the same way.
- reinforce: -A logp weighted by the stop-gradient ratio clamp(r, 0, 1 + eps_hi) (PipelineRL's off-policy
  correction: stale samples are down-weighted, never up-weighted beyond 1 + eps).
- sft: cross-entropy -logp on the unmasked tokens (advantages ignored).

Every loss is a SUM over loss tokens divided by `normalizer`, the number of loss tokens of the whole optimizer
step, so that micro-batches accumulate to the same gradient as one big batch. Statistics come back as sums
(`LossStats`) that merge across micro-batches before being turned into means.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

LossKind = Literal["grpo", "ppo", "gspo", "reinforce", "sft"]
LOSS_KINDS: tuple[str, ...] = ("grpo", "ppo", "gspo", "reinforce", "sft")


@dataclass(frozen=True)
class LossConfig:
    kind: LossKind = "grpo"
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # and above at 1 + clip_high

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"spec.algorithm.loss: unknown loss {self.kind!r} (known: {', '.join(LOSS_KINDS)})")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"spec.algorithm.clipEpsilonLow must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"spec.algorithm.clipEpsilonHigh must be >= 0, got {self.clip_high}")


@dataclass
class LossStats:
    """Sums over loss tokens (and sequences); `merge` adds micro-batches, `metrics` turns them into means."""

    tokens: float = 0.0
    sequences: float = 0.0
    loss_sum: float = 0.0  # un-normalised sum of per-token losses
    ratio_sum: float = 0.0
    clipped: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    entropy_tokens: float = 0.0

    def merge(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def metrics(self, normalizer: float | None = None) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        out = {
            "loss": self.loss_sum / (normalizer or n),
            "ratio_mean": self.ratio_sum / n if self.tokens else 1.0,
            "clipped_fraction": self.clipped / n,
            "kl": self.kl_sum / n,
            "loss_tokens": self.tokens,
        }
        if self.entropy_tokens:
            out["entropy"] = self.entropy_sum / self.entropy_tokens
        return out


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar with gradient: sum of per-token losses / normalizer
    stats: LossStats


def _clipped_objective(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(-min(r A, clip(r) A), where clipping binds) elementwise."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
    loss = -torch.minimum(unclipped, clipped)
    # Clipping binds (gradient zero) when the clipped term is strictly the smaller one.
    binds = clipped < unclipped
    return loss, binds


def policy_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    normalizer: float | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of one (micro-)batch. Shapes: new_logp, old_logp, mask, entropy [B, T]; advantages [B]."""
    if new_logp.shape != old_logp.shape or new_logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: new {tuple(new_logp.shape)}, old {tuple(old_logp.shape)}, mask {tuple(mask.shape)}")
    if advantages.shape != new_logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={new_logp.shape[0]}, got {tuple(advantages.shape)}")
    maskf = mask.to(new_logp.dtype)
    tokens = float(maskf.sum())
    norm = float(normalizer) if normalizer is not None else max(tokens, 1.0)
    if norm <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    old_logp = old_logp.to(new_logp.dtype).detach()
    adv = advantages.to(new_logp.dtype)[:, None].expand_as(new_logp)
    log_ratio = torch.where(mask, new_logp - old_logp, torch.zeros_like(new_logp))
    ratio = torch.exp(log_ratio)

    if config.kind in ("grpo", "ppo"):
        per_token, binds = _clipped_objective(ratio, adv, config.clip_low, config.clip_high)
        shown_ratio = ratio
    elif config.kind == "gspo":
        lengths = maskf.sum(dim=1).clamp(min=1.0)
        seq_ratio = torch.exp((log_ratio * maskf).sum(dim=1) / lengths)  # [B]
        seq_loss, seq_binds = _clipped_objective(seq_ratio, advantages.to(new_logp.dtype), config.clip_low, config.clip_high)
        per_token = seq_loss[:, None].expand_as(new_logp)
        binds = seq_binds[:, None].expand_as(new_logp)
        shown_ratio = seq_ratio[:, None].expand_as(new_logp)
    elif config.kind == "reinforce":
        weight = ratio.detach().clamp(0.0, 1.0 + config.clip_high)
        per_token = -new_logp * adv * weight
        binds = ratio.detach() > 1.0 + config.clip_high
        shown_ratio = ratio
    else:  # sft
        per_token = -new_logp
        binds = torch.zeros_like(mask)
        shown_ratio = ratio

    loss_sum = (per_token * maskf).sum()
    with torch.no_grad():
        # k3 estimator of KL(old || new) from samples of the old policy: r - 1 - log r >= 0.
        kl = ratio - 1.0 - log_ratio
        stats = LossStats(
            tokens=tokens,
            sequences=float((maskf.sum(dim=1) > 0).sum()),
            loss_sum=float(loss_sum),
            ratio_sum=float((shown_ratio * maskf).sum()),
            clipped=float((binds & mask).sum()),
            kl_sum=float((kl * maskf).sum()),
        )
        if entropy is not None:
            stats.entropy_sum = float((entropy * maskf).sum())
            stats.entropy_tokens = tokens
    return LossOutput(loss=loss_sum / norm, stats=stats)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at each position, [B, T, V] -> [B, T] (no gradient)."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), dim=-1)
        return -(logp.exp() * logp).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of tokens[:, 1:] under logits[:, :-1] / temperature -> [B, T-1] (float32 whatever the logits' dtype).
    The native engine's sampling log-probs are of the same temperature-scaled distribution."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
