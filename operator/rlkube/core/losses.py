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


# --- log-probs and entropy from hidden states, chunked over the tokens ---------------------------------------------
#
# `token_logprobs` / `token_entropy` above take the full logits [B, T, V]: at a real vocabulary (Qwen's 151,936) and
# 8,192 tokens one float32 copy is ~5 GB, and the log-softmax, its saved output, the entropy's second log-softmax and
# the backward's gradient of the logits are more copies of that size. `chunked_token_logprobs` takes the model's
# final hidden states instead and runs the LM head + log-softmax + gather + entropy over `chunk_size` tokens at a
# time under activation checkpointing: the forward keeps only each chunk's log-probs, the backward recomputes one
# chunk's logits at a time, so the loss holds O(chunk_size x V) instead of O(tokens x V). Same values and gradients
# as the full path (up to float32 summation order).

DEFAULT_LOSS_CHUNK_TOKENS = 1024


class VocabParallel:
    """How the LM head's output is split over the vocabulary (tensor parallelism): this rank holds logits of vocabulary
    ids [offset, offset + its width); `max_` all-reduces a MAX in place (no gradient), `sum` all-reduces a SUM whose
    backward is the identity (every rank computes the same loss, so each keeps the gradient of its own shard)."""

    def __init__(self, offset: int, max_, sum_):
        self.offset = offset
        self.max_ = max_
        self.sum = sum_


def _chunk_logprobs(head, temperature: float, vocab: VocabParallel | None, hidden: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of `targets` under head(hidden) / temperature, entropy of head(hidden) without gradient) for one
    chunk: hidden [N, H], targets [N] -> [N], [N]. The entropy is of the untempered distribution, as
    `token_entropy`'s."""
    logits = head(hidden).float()
    if vocab is None:
        logp_all = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        with torch.no_grad():
            plain = logp_all if temperature == 1.0 else torch.log_softmax(logits, dim=-1)
            entropy = -plain.exp().mul_(plain).sum(dim=-1)  # one [chunk, V] temporary, not two
        return logp, entropy
    scaled = logits / temperature if temperature != 1.0 else logits
    width = logits.shape[-1]
    with torch.no_grad():
        top = scaled.max(dim=-1).values
        vocab.max_(top)
    shifted = scaled - top[:, None]  # the maximum cancels out of the log-softmax: no gradient needed through it
    total = vocab.sum(shifted.exp().sum(dim=-1))
    local = targets - vocab.offset
    here = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1)[:, None]).squeeze(-1) * here
    logp = vocab.sum(picked) - total.log()
    with torch.no_grad():
        top = logits.max(dim=-1).values
        vocab.max_(top)
        z = logits - top[:, None]
        e = z.exp()
        norm = e.sum(dim=-1)
        norm = vocab.sum(norm)
        ez = vocab.sum((e * z).sum(dim=-1))
        entropy = norm.log() - ez / norm  # -sum p log p with p = e / norm, log p = z - log norm
    return logp, entropy


def chunked_token_logprobs(hidden: torch.Tensor, head, tokens: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = DEFAULT_LOSS_CHUNK_TOKENS,
                           vocab: VocabParallel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `token_logprobs(logits, tokens, temperature)` and `token_entropy(logits[:, :-1])` give, from the model's
    final hidden states [B, T, H] and its LM head (`head`: [N, H] -> logits [N, V], or this rank's vocabulary shard
    with `vocab`), chunk_size tokens at a time: -> (log-probs [B, T-1] float32 with gradient, entropy [B, T-1])."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    from torch.utils.checkpoint import checkpoint

    b, t = tokens.shape
    flat = hidden[:, :-1].reshape(b * (t - 1), hidden.shape[-1])
    targets = tokens[:, 1:].reshape(-1).to(hidden.device)
    logps, entropies = [], []
    for start in range(0, flat.shape[0], chunk_size):
        h, y = flat[start:start + chunk_size], targets[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            # non-reentrant: the forward saves only h (the chunk's logits are freed), the backward reruns this chunk
            logp, entropy = checkpoint(_chunk_logprobs, head, temperature, vocab, h, y, use_reentrant=False,
                                       preserve_rng_state=False)
        else:
            logp, entropy = _chunk_logprobs(head, temperature, vocab, h, y)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden[:, :0, 0].float()  # [B, 0], attached to the graph as the full path's
        return empty, empty.detach()
    return torch.cat(logps).view(b, t - 1), torch.cat(entropies).view(b, t - 1)
