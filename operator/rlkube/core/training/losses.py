"""Policy losses over per-token log-probs (pure torch, no model, no I/O), shared by every torch-based backend.

Why one module: the torch and megatron backends must train the same objective, so the losses (grpo/ppo, gspo,
reinforce, sft), the off-policy correction (tis, mis), the KL term and the chunked log-probs are written once.
The old log-prob is the actor's SAMPLING log-prob: the ratio is new/old, not new/new-detached
(docs/references.md §6.15). Every loss is a SUM over loss tokens divided by the step's loss-token count, so
micro-batches accumulate to one big batch's gradient. The definitions and their sources: docs/design.md §6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch

LossKind = Literal["grpo", "ppo", "gspo", "reinforce", "sft"]
LOSS_KINDS: tuple[str, ...] = ("grpo", "ppo", "gspo", "reinforce", "sft")
OFF_POLICY_MODES: tuple[str, ...] = ("none", "tis", "mis")
OFF_POLICY_LEVELS: tuple[str, ...] = ("token", "sequence")
LOG_RATIO_BOUND = 20.0  # |log w| is clamped to this before exp (verl rollout_corr_helper's SAFETY_BOUND)


@dataclass(frozen=True)
class OffPolicyConfig:
    """Trainer/sampler mismatch correction (module docstring). `lower` is for mis only; None means 1 / cap."""

    mode: str = "none"
    level: str = "token"
    cap: float = 2.0
    lower: float | None = None

    def __post_init__(self) -> None:
        where = "spec.algorithm.offPolicyCorrection"
        if self.mode not in OFF_POLICY_MODES:
            raise ValueError(f"{where}.mode: unknown mode {self.mode!r} (known: {', '.join(OFF_POLICY_MODES)})")
        if self.level not in OFF_POLICY_LEVELS:
            raise ValueError(f"{where}.level: unknown level {self.level!r} (known: {', '.join(OFF_POLICY_LEVELS)})")
        if not self.cap >= 1.0:
            raise ValueError(f"{where}.cap must be >= 1, got {self.cap}")
        if self.lower is not None and not 0.0 <= self.lower <= self.cap:
            raise ValueError(f"{where}.lower must be in [0, cap={self.cap}], got {self.lower}")

    @property
    def lower_bound(self) -> float:
        return 1.0 / self.cap if self.lower is None else self.lower


@dataclass(frozen=True)
class LossConfig:
    kind: LossKind = "grpo"
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # and above at 1 + clip_high
    off_policy: OffPolicyConfig = OffPolicyConfig()
    kl_coef: float = 0.0  # weight of the k3 KL to the reference policy (needs ref_logp)

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"spec.algorithm.loss: unknown loss {self.kind!r} (known: {', '.join(LOSS_KINDS)})")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"spec.algorithm.clipEpsilonLow must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise ValueError(f"spec.algorithm.clipEpsilonHigh must be >= 0, got {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"spec.algorithm.klCoef must be >= 0, got {self.kl_coef}")


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
    # trainer vs sampler (off-policy correction, module docstring)
    logp_diff_abs_sum: float = 0.0  # sum over loss tokens of |logp_trainer - logp_sampler|
    is_ratios: float = 0.0  # importance ratios counted (loss tokens, or sequences at level sequence)
    is_ratio_sum: float = 0.0
    is_ratio_min: float = math.inf  # merged by min (EXTREMA), not summed
    is_ratio_max: float = -math.inf  # merged by max
    is_truncated: float = 0.0  # loss tokens whose weight tis truncated at the cap
    is_masked: float = 0.0  # loss tokens mis dropped
    ref_kl_sum: float = 0.0  # k3 KL to the reference policy, summed over loss tokens
    ref_kl_tokens: float = 0.0

    # Fields merged by min / max instead of summed (data parallelism reduces them the same way: trainer/parallel.py).
    EXTREMA: ClassVar[dict[str, str]] = {"is_ratio_min": "min", "is_ratio_max": "max"}

    def merge(self, other: LossStats) -> LossStats:
        def combine(name: str) -> float:
            a, b = getattr(self, name), getattr(other, name)
            how = self.EXTREMA.get(name)
            return min(a, b) if how == "min" else max(a, b) if how == "max" else a + b

        return LossStats(**{f.name: combine(f.name) for f in fields(self)})

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
        if self.tokens:
            out["logprob_diff_abs"] = self.logp_diff_abs_sum / n
            out["is_truncated_fraction"] = self.is_truncated / n
            out["is_masked_fraction"] = self.is_masked / n
        if self.is_ratios:
            out["is_ratio_mean"] = self.is_ratio_sum / self.is_ratios
            out["is_ratio_min"] = self.is_ratio_min
            out["is_ratio_max"] = self.is_ratio_max
        if self.ref_kl_tokens:
            out["ref_kl"] = self.ref_kl_sum / self.ref_kl_tokens
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


def importance_weights(log_w: torch.Tensor, maskf: torch.Tensor, config: OffPolicyConfig
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached off-policy weights of the module docstring from `log_w` = logp_trainer - logp_sampler [B, T]
    (0 off the mask). Returns (per-token weight [B, T], the raw ratios at the configured level ([B, T] or [B]),
    which of them count ([B, T] or [B] bool), per-token bool: truncated or masked)."""
    with torch.no_grad():
        if config.level == "sequence":
            ratio = torch.exp((log_w * maskf).sum(dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [B]
            counted = maskf.sum(dim=1) > 0
        else:
            ratio = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
            counted = maskf > 0
        if config.mode == "tis":
            weight = ratio.clamp(max=config.cap)
            changed = ratio > config.cap
        elif config.mode == "mis":
            keep = (ratio >= config.lower_bound) & (ratio <= config.cap)
            weight = torch.where(keep, ratio, torch.zeros_like(ratio))
            changed = ~keep
        else:
            weight, changed = torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
        if config.level == "sequence":
            weight, changed = weight[:, None].expand_as(log_w), changed[:, None].expand_as(log_w)
        return weight, ratio, counted, changed


def policy_loss(
    new_logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    normalizer: float | None = None,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of one (micro-)batch. Shapes: new_logp, old_logp, mask, entropy, ref_logp [B, T]; advantages [B].
    `old_logp` are the sampler's log-probs; `ref_logp` the reference policy's (needed when config.kl_coef > 0)."""
    if new_logp.shape != old_logp.shape or new_logp.shape != mask.shape:
        raise ValueError(f"shape mismatch: new {tuple(new_logp.shape)}, old {tuple(old_logp.shape)}, mask {tuple(mask.shape)}")
    if advantages.shape != new_logp.shape[:1]:
        raise ValueError(f"advantages must be [B]={new_logp.shape[0]}, got {tuple(advantages.shape)}")
    if config.kl_coef > 0 and (ref_logp is None or ref_logp.shape != new_logp.shape):
        raise ValueError(f"klCoef {config.kl_coef} needs the reference log-probs of shape {tuple(new_logp.shape)}")
    maskf = mask.to(new_logp.dtype)
    tokens = float(maskf.sum())
    norm = float(normalizer) if normalizer is not None else max(tokens, 1.0)
    if norm <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    sampler_logp = old_logp.to(new_logp.dtype).detach()
    # trainer vs sampler, in value (what every mismatch metric and the off-policy weight are made of)
    mismatch = torch.where(mask, new_logp.detach() - sampler_logp, torch.zeros_like(new_logp))
    corrected = config.off_policy.mode != "none" and config.kind != "sft"
    # Decoupled (module docstring): with a correction the PPO ratio is against the trainer itself (its proximal
    # policy, detached), and the sampler enters only through the importance weight below.
    old_logp = new_logp.detach() if corrected else sampler_logp
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

    is_weight, is_ratio, is_counted, is_changed = importance_weights(mismatch, maskf, config.off_policy)
    if corrected:
        per_token = per_token * is_weight
    loss_sum = (per_token * maskf).sum()
    ref_kl = None
    if config.kl_coef > 0:
        # k3 of KL(pi || pi_ref) (module docstring), with gradient through new_logp.
        d = torch.where(mask, ref_logp.to(new_logp.dtype).detach() - new_logp, torch.zeros_like(new_logp))
        ref_kl = torch.exp(d.clamp(max=LOG_RATIO_BOUND)) - d - 1.0
        loss_sum = loss_sum + config.kl_coef * (ref_kl * maskf).sum()
    with torch.no_grad():
        # k3 estimator of KL(sampler || trainer) from the sampler's samples: r - 1 - log r >= 0.
        kl = torch.exp(mismatch) - 1.0 - mismatch
        changed = is_changed & mask if corrected else torch.zeros_like(mask)
        stats = LossStats(
            tokens=tokens,
            sequences=float((maskf.sum(dim=1) > 0).sum()),
            loss_sum=float(loss_sum),
            ratio_sum=float((shown_ratio * maskf).sum()),
            clipped=float((binds & mask).sum()),
            kl_sum=float((kl * maskf).sum()),
            logp_diff_abs_sum=float((mismatch.abs() * maskf).sum()),
            is_ratios=float(is_counted.sum()),
            is_ratio_sum=float(is_ratio[is_counted].sum()),
            is_ratio_min=float(is_ratio[is_counted].min()) if bool(is_counted.any()) else math.inf,
            is_ratio_max=float(is_ratio[is_counted].max()) if bool(is_counted.any()) else -math.inf,
            is_truncated=float(changed.sum()) if config.off_policy.mode == "tis" else 0.0,
            is_masked=float(changed.sum()) if config.off_policy.mode == "mis" else 0.0,
        )
        if ref_kl is not None:
            stats.ref_kl_sum = float((ref_kl.detach() * maskf).sum())
            stats.ref_kl_tokens = tokens
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
# final hidden states instead and runs the LM head over `chunk_size` tokens at a time under activation
# checkpointing: the forward keeps only each chunk's log-probs, the backward recomputes one chunk's logits at a time.
# From a chunk's logits, `_LogprobEntropy` computes the log-probs and the entropy without another [chunk, V] tensor
# (the reductions run over a few rows at a time) and saves only the logits and one log-normaliser per token; its
# backward overwrites the (recomputed) logits in place with their gradient p * -g + onehot * g (scaled by
# 1 / temperature), as Liger's and torchtune's chunked cross-entropy do. So the loss holds ONE [chunk, V] float32
# tensor at a time (`rlkube bench loss-memory`), O(chunk_size x V) instead of O(tokens x V), with the same values
# and gradients as the full path (up to float32 summation order).

DEFAULT_LOSS_CHUNK_TOKENS = 1024
_BLOCK_ELEMENTS = 1 << 22  # elements of the temporaries of `_LogprobEntropy.forward` (16 MiB of float32)


class VocabParallel:
    """How the LM head's output is split over the vocabulary (tensor parallelism): this rank holds logits of vocabulary
    ids [offset, offset + its width); `max_` all-reduces a MAX in place (no gradient), `sum` all-reduces a SUM whose
    backward is the identity (every rank computes the same loss, so each keeps the gradient of its own shard)."""

    def __init__(self, offset: int, max_, sum_):
        self.offset = offset
        self.max_ = max_
        self.sum = sum_


class _LogprobEntropy(torch.autograd.Function):
    """logits [N, V] float32 (this rank's vocabulary shard with `vocab`), targets [N] -> (log-prob of the targets
    under logits / temperature [N] with gradient, entropy of the untempered distribution [N] without).

    Saves the logits themselves and the log-normaliser [N]; the backward turns the saved logits into their gradient
    IN PLACE (the section comment above), so it may run once per forward: `chunked_token_logprobs` calls it under
    non-reentrant checkpointing, which recomputes the logits for every backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab: VocabParallel | None):
        n, width = logits.shape
        offset = vocab.offset if vocab is not None else 0
        tempered = temperature != 1.0
        # The maxima (no gradient needed through them: they cancel out of the log-softmax), all ranks'.
        top = logits.amax(dim=-1)
        if vocab is not None:
            vocab.max_(top)
        top_t = top / temperature  # the maximum of x / T (T > 0)
        # sum e and sum e z with z = x - max, e = exp(z) (the entropy's), and sum exp(x/T - max/T) (the tempered
        # normaliser), over a few rows at a time so that no other [N, V] tensor exists.
        sums = logits.new_zeros(3 if tempered else 2, n)
        rows = max(1, _BLOCK_ELEMENTS // max(width, 1))
        for start in range(0, n, rows):
            r = slice(start, start + rows)
            block = logits[r]
            z = block - top[r, None]
            e = torch.exp(z)
            sums[0, r] = e.sum(dim=-1)
            sums[1, r] = e.mul_(z).sum(dim=-1)
            del z, e
            if tempered:
                sums[2, r] = torch.exp(block / temperature - top_t[r, None]).sum(dim=-1)
        local = targets - offset
        here = (local >= 0) & (local < width)
        picked = logits.gather(-1, local.clamp(0, max(width - 1, 0))[:, None]).squeeze(-1) * here
        if vocab is not None:
            sums = vocab.sum(sums)
            picked = vocab.sum(picked)
        norm, ez = sums[0], sums[1]
        entropy = norm.log() - ez / norm  # -sum p log p with p = e / norm, log p = z - log norm
        lse = top_t + (sums[2] if tempered else norm).log()  # log sum exp(x / T), all ranks'
        logp = picked / temperature - lse
        ctx.save_for_backward(logits, local, here, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        logits, local, here, lse = ctx.saved_tensors
        t = ctx.temperature
        g = grad_logp / t
        # d logp / d x = (onehot(target) - softmax(x / T)) / T, written over the logits (no new [N, V] tensor)
        grad = logits.mul_(1.0 / t) if t != 1.0 else logits
        grad.sub_(lse[:, None]).exp_().mul_(-g[:, None])
        grad.scatter_add_(-1, local.clamp(0, max(grad.shape[-1] - 1, 0))[:, None], (g * here)[:, None])
        return grad, None, None, None


def _chunk_logprobs(head, temperature: float, vocab: VocabParallel | None, hidden: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of `targets` under head(hidden) / temperature, entropy of head(hidden) without gradient) for one
    chunk: hidden [N, H], targets [N] -> [N], [N]. The entropy is of the untempered distribution, as
    `token_entropy`'s. In float32 whatever the head's dtype, except float64 (kept: the gradient check)."""
    logits = head(hidden)
    return _LogprobEntropy.apply(logits if logits.dtype == torch.float64 else logits.float(), targets, temperature,
                                 vocab)


def chunked_token_logprobs(hidden: torch.Tensor, head, tokens: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = DEFAULT_LOSS_CHUNK_TOKENS,
                           vocab: VocabParallel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What `token_logprobs(logits, tokens, temperature)` and `token_entropy(logits[:, :-1])` give, from the model's
    final hidden states [B, T, H] and its LM head (`head`: [N, H] -> logits [N, V], or this rank's vocabulary shard
    with `vocab`), chunk_size tokens at a time: -> (log-probs [B, T-1] float32 with gradient, entropy [B, T-1]).
    `head` must be linear-like: its backward must not need its own output, which the loss's backward overwrites with
    its gradient (nn.Linear, a LoRA-adapted Linear, megatron's output layer; not e.g. a tanh soft-cap)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    from torch.utils.checkpoint import checkpoint

    b, t = tokens.shape
    flat = hidden[:, :-1].reshape(b * (t - 1), hidden.shape[-1])
    targets = tokens[:, 1:].reshape(-1).to(hidden.device)
    logps, entropies = [], []
    for start in range(0, flat.shape[0], chunk_size):
        h, y = flat[start:start + chunk_size], targets[start:start + chunk_size]
        if torch.is_grad_enabled():
            # non-reentrant: the forward saves only h (the chunk's logits are freed), every backward reruns this
            # chunk (which `_LogprobEntropy.backward` needs: it overwrites the logits). Also when only the head's
            # parameters need a gradient (h does not: a LoRA adapter on the LM head alone).
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
