"""Off-policy correction (TIS / MIS, token and sequence level) and the KL to a reference policy
(rlkube.core.training.losses).

The gradient tests use a one-step "language model": a categorical policy pi = softmax(theta) over V actions, a
sampler mu = softmax(theta + delta) that is off by a KNOWN amount delta, and batches stratified exactly by mu
(action a appears round(N mu(a)) times), so the only error against the exact on-policy gradient
-sum_a pi(a) A(a) grad log pi(a) is the rounding of the counts: no Monte-Carlo noise, and a tight tolerance.
"""

import math

import numpy as np
import pytest
import torch

from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.core.training.losses import LossConfig, LossStats, OffPolicyConfig, policy_loss

F64 = torch.float64
THETA = torch.tensor([0.3, -0.2, 0.8, 0.0, -0.6, 0.4], dtype=F64)
ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.5], dtype=F64)
# The sampler under-rates the good actions and over-rates the bad ones: pi/mu is ~1.5 where A > 0 and ~0.7 where
# A < 0, exactly where PPO's clip (0.8, 1.2) binds; every ratio is within [0.5, 2] (the default cap).
DELTA = torch.tensor([-0.45, 0.35, -0.3, 0.4, -0.4, 0.3], dtype=F64)
N = 200_000
TOLERANCE = 1e-3  # relative L2 error of a corrected gradient against the exact on-policy one


def _sampler_logp() -> torch.Tensor:
    return torch.log_softmax(THETA + DELTA, dim=0)


def _stratified(probs: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.round(probs * n).long()
    return torch.repeat_interleave(torch.arange(len(probs)), counts)


def _on_policy_gradient(keep: torch.Tensor | None = None) -> torch.Tensor:
    """-sum_a pi(a) A(a) grad log pi(a) (restricted to the actions in `keep`)."""
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    weight = logp.exp().detach() * ADV * (keep.to(F64) if keep is not None else 1.0)
    (-(weight * logp).sum()).backward()
    return theta.grad


def _loss_gradient(config: LossConfig):
    """The gradient of policy_loss on a batch of single-token documents stratified by the sampler."""
    sampler_logp = _sampler_logp()
    actions = _stratified(sampler_logp.exp(), N)
    theta = THETA.clone().requires_grad_(True)
    new = torch.log_softmax(theta, dim=0)[actions][:, None]
    old = sampler_logp[actions][:, None]
    out = policy_loss(new, old, ADV[actions], torch.ones_like(new, dtype=torch.bool), config)
    out.loss.backward()
    return theta.grad, out.stats.metrics()


def _rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g - ref).norm() / ref.norm())


def _ratios() -> torch.Tensor:
    return torch.exp(torch.log_softmax(THETA, dim=0) - _sampler_logp())


def test_the_known_mismatch_is_where_ppo_clips():
    r = _ratios()
    assert bool(((r > 1.2) == (ADV > 0)).all()) and bool(((r < 0.8) == (ADV < 0)).all())
    assert 0.5 < float(r.min()) and float(r.max()) < 2.0


@pytest.mark.parametrize("kind", ["grpo", "reinforce", "gspo"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_corrected_gradient_matches_on_policy_and_uncorrected_does_not(kind, mode):
    exact = _on_policy_gradient()
    corrected, metrics = _loss_gradient(LossConfig(kind, off_policy=OffPolicyConfig(mode, "token", cap=2.0)))
    uncorrected, _ = _loss_gradient(LossConfig(kind))  # the PPO ratio against the sampler, clipped at 1 +- 0.2
    # Ignoring the mismatch (training as if the sampler were the policy: ratio 1 everywhere).
    actions = _stratified(_sampler_logp().exp(), N)
    theta = THETA.clone().requires_grad_(True)
    new = torch.log_softmax(theta, dim=0)[actions][:, None]
    policy_loss(new, new.detach(), ADV[actions], torch.ones_like(new, dtype=torch.bool), LossConfig(kind)).loss.backward()
    naive = theta.grad
    print(f"\n{kind}/{mode}: relative L2 error vs the on-policy gradient: corrected {_rel(corrected, exact):.2e}, "
          f"uncorrected (PPO ratio vs sampler) {_rel(uncorrected, exact):.3f}, ignoring the sampler "
          f"{_rel(naive, exact):.3f}")
    assert _rel(corrected, exact) < TOLERANCE
    # grpo / gspo (a one-token document's sequence ratio is its token ratio): the clip binds on every token, the
    # mismatch eats the whole gradient (error 1.0); reinforce's weight min(r, 1 + eps) truncates at 1.2 (~0.1).
    assert _rel(uncorrected, exact) > (0.05 if kind == "reinforce" else 0.5)
    assert _rel(naive, exact) > 0.1
    # The mismatch metrics: mean |log pi - log mu|, the ratio's statistics; nothing truncated or masked.
    mu = _sampler_logp().exp()
    r = _ratios()
    assert metrics["logprob_diff_abs"] == pytest.approx(float((mu * r.log().abs()).sum()), rel=1e-3)
    assert metrics["is_ratio_mean"] == pytest.approx(1.0, rel=1e-3)  # E_mu[pi/mu] = 1
    assert metrics["is_ratio_min"] == pytest.approx(float(r.min()))
    assert metrics["is_ratio_max"] == pytest.approx(float(r.max()))
    assert metrics["is_truncated_fraction"] == 0 and metrics["is_masked_fraction"] == 0


def test_truncation_and_masking_at_a_binding_cap_by_hand():
    cap = 1.4
    r, mu = _ratios(), _sampler_logp().exp()
    above = r > cap
    assert 0 < int(above.sum()) < len(r)
    # TIS: the weight is min(pi/mu, cap): expectation sum_a mu(a) min(r_a, cap) A(a) grad log pi(a).
    tis, m = _loss_gradient(LossConfig("grpo", off_policy=OffPolicyConfig("tis", cap=cap)))
    theta = THETA.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    (-(mu * r.clamp(max=cap) * ADV * logp).sum()).backward()
    assert _rel(tis, theta.grad) < TOLERANCE
    assert m["is_truncated_fraction"] == pytest.approx(float(mu[above].sum()), rel=1e-3)
    assert m["is_masked_fraction"] == 0
    # MIS: the actions whose ratio is out of [1/cap, cap] drop out, the others keep their full weight.
    keep = (r >= 1 / cap) & (r <= cap)
    mis, m = _loss_gradient(LossConfig("grpo", off_policy=OffPolicyConfig("mis", cap=cap)))
    assert _rel(mis, _on_policy_gradient(keep)) < TOLERANCE
    assert m["is_masked_fraction"] == pytest.approx(float(mu[~keep].sum()), rel=1e-3)
    assert m["is_truncated_fraction"] == 0
    # an explicit lower bound of 0: only the upper side masks
    _, m = _loss_gradient(LossConfig("grpo", off_policy=OffPolicyConfig("mis", cap=cap, lower=0.0)))
    assert m["is_masked_fraction"] == pytest.approx(float(mu[above].sum()), rel=1e-3)


# Sequence level: documents of two tokens drawn independently, an advantage that depends on BOTH tokens. The
# per-sequence weight (the product of the token ratios) is the importance weight of the whole sample, so it is
# unbiased; a per-token weight corrects only its own token's distribution, not its neighbour's (Liu, Li et al.
# 2025, "When Speed Kills Stability", section 4.2.1).
V2 = 4
THETA2 = torch.tensor([0.5, -0.3, 0.1, -0.4], dtype=F64)
DELTA2 = torch.tensor([-0.3, 0.3, -0.2, 0.25], dtype=F64)
SCORE = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)


def _pair_advantage(a1: torch.Tensor, a2: torch.Tensor) -> torch.Tensor:
    return SCORE[a1] * SCORE[a2] + SCORE[a1]


def _sequence_gradient(config: LossConfig):
    mu = torch.softmax(THETA2 + DELTA2, dim=0)
    pairs = _stratified(torch.outer(mu, mu).reshape(-1), N)
    a1, a2 = pairs // V2, pairs % V2
    theta = THETA2.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    new = torch.stack([logp[a1], logp[a2]], dim=1)
    old = torch.stack([mu.log()[a1], mu.log()[a2]], dim=1)
    out = policy_loss(new, old, _pair_advantage(a1, a2), torch.ones_like(new, dtype=torch.bool), config)
    out.loss.backward()
    return theta.grad, out.stats.metrics()


def test_sequence_level_weight_is_unbiased_where_token_level_is_not():
    theta = THETA2.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=0)
    pi = logp.exp().detach()
    a1, a2 = torch.arange(V2).repeat_interleave(V2), torch.arange(V2).repeat(V2)
    # per token: -A grad log pi(a_t), averaged over the 2 loss tokens of a document (the normaliser)
    (-(pi[a1] * pi[a2] * _pair_advantage(a1, a2) * (logp[a1] + logp[a2])).sum() / 2).backward()
    exact = theta.grad
    seq, m = _sequence_gradient(LossConfig("grpo", off_policy=OffPolicyConfig("tis", "sequence", cap=10.0)))
    tok, _ = _sequence_gradient(LossConfig("grpo", off_policy=OffPolicyConfig("tis", "token", cap=10.0)))
    unc, _ = _sequence_gradient(LossConfig("grpo"))
    print(f"\nsequence-level data: relative L2 error vs on-policy: tis sequence {_rel(seq, exact):.2e}, "
          f"tis token {_rel(tok, exact):.3f}, uncorrected {_rel(unc, exact):.3f}")
    assert _rel(seq, exact) < TOLERANCE
    assert _rel(tok, exact) > 0.02
    assert _rel(unc, exact) > 0.1
    # ratio statistics are per sequence at this level: E_mu[prod pi/mu] = 1
    assert m["is_ratio_mean"] == pytest.approx(1.0, rel=1e-3)
    r = torch.softmax(THETA2, dim=0) / torch.softmax(THETA2 + DELTA2, dim=0)
    assert m["is_ratio_max"] == pytest.approx(float(r.max() ** 2))


def test_metrics_by_hand_and_min_max_merge_across_micro_batches():
    # trainer log-probs 0 (ratio = 1 / sampler prob); sampler ratios 3, 0.25, 1.5 | 1, masked
    new = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    old = -torch.tensor([[3.0, 0.25, 1.5], [1.0, 1.0, 7.0]], dtype=F64).log()
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    cfg = LossConfig("grpo", off_policy=OffPolicyConfig("tis", cap=2.0))
    out = policy_loss(new, old, adv, mask, cfg)
    m = out.stats.metrics()
    logs = [math.log(3), math.log(0.25), math.log(1.5), 0.0]
    assert m["logprob_diff_abs"] == pytest.approx(sum(abs(x) for x in logs) / 4)
    assert m["is_ratio_mean"] == pytest.approx((3 + 0.25 + 1.5 + 1) / 4)
    assert (m["is_ratio_min"], m["is_ratio_max"]) == (pytest.approx(0.25), pytest.approx(3.0))
    assert m["is_truncated_fraction"] == pytest.approx(1 / 4)
    # loss: the weights are min(r, 2) = 2, 0.25, 1.5 | 1 times -A (the PPO ratio against the trainer is 1)
    assert out.loss.item() == pytest.approx(-(2 + 0.25 + 1.5 - 1) / 4)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-2, -0.25, -1.5], [1, 0, 0]], dtype=F64) / 4)
    # two micro-batches: sums add, extrema take the min / max; an empty one changes nothing
    a = policy_loss(new[:1], old[:1], adv[:1], mask[:1], cfg).stats
    b = policy_loss(new[1:], old[1:], adv[1:], mask[1:], cfg).stats
    merged = LossStats().merge(a).merge(b).merge(LossStats()).metrics()
    for key in ("logprob_diff_abs", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_truncated_fraction"):
        assert merged[key] == pytest.approx(m[key]), key
    # sequence level: one ratio per document, exp(sum of its log-ratios) = 3 x 0.25 x 1.5 and 1
    seq = policy_loss(new, old, adv, mask, LossConfig("grpo", off_policy=OffPolicyConfig("mis", "sequence"))).stats
    sm = seq.metrics()
    assert (sm["is_ratio_min"], sm["is_ratio_max"]) == (pytest.approx(1.0), pytest.approx(1.125))
    assert sm["is_masked_fraction"] == 0
    seq = policy_loss(new, old, adv, mask, LossConfig("grpo", off_policy=OffPolicyConfig("mis", "sequence",
                                                                                         cap=1.1))).stats
    assert seq.metrics()["is_masked_fraction"] == pytest.approx(3 / 4)  # the first document's 3 tokens


def test_default_is_unchanged_and_still_reports_the_mismatch():
    new = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]], dtype=F64)
    args = (new, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool))
    out = policy_loss(*args, LossConfig("grpo"))
    r = [math.exp(0.5), math.exp(-1.0)]
    assert out.loss.item() == pytest.approx(-(1.2 + r[1]) / 2)  # clipped at 1.2 against the sampler, as before
    m = out.stats.metrics()
    assert m["logprob_diff_abs"] == pytest.approx(0.75)
    assert m["is_ratio_max"] == pytest.approx(r[0])
    assert m["is_truncated_fraction"] == 0 and m["is_masked_fraction"] == 0 and "ref_kl" not in m


def test_k3_kl_to_the_reference_by_hand():
    new = torch.tensor([[math.log(0.5), math.log(0.25)]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]], dtype=F64)
    adv, mask = torch.tensor([0.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(new, new.detach(), adv, mask, LossConfig("grpo", kl_coef=0.5), ref_logp=ref)
    # k3 = exp(ref - new) - (ref - new) - 1: 0.5 + log 2 - 1 and 0 -> loss 0.5 x mean
    k3 = 0.5 + math.log(2) - 1
    assert out.stats.metrics()["ref_kl"] == pytest.approx(k3 / 2)
    assert out.loss.item() == pytest.approx(0.5 * k3 / 2)
    out.loss.backward()
    # d k3 / d new = 1 - exp(ref - new): 1 - 0.5 and 0; x 0.5 / 2 tokens
    torch.testing.assert_close(new.grad, torch.tensor([[0.125, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="reference log-probs"):
        policy_loss(new, new.detach(), adv, mask, LossConfig("grpo", kl_coef=0.5))


SPEC = {
    "model": {"path": "builtin://tiny-llama", "maxSequenceLength": 16},
    "algorithm": {"maxSteps": 3, "samplesPerStep": 4},
    "inference": {"engine": "native"},
}


def _spec(algorithm=None, trainer=None, **top):
    raw = {**SPEC, "algorithm": {**SPEC["algorithm"], **(algorithm or {})}, **top}
    if trainer:
        raw["trainer"] = trainer
    return parse_spec(raw)


def test_spec_fields_defaults_bounds_and_refusals():
    algo = _spec().algorithm
    assert algo.off_policy_correction.mode == "none" and algo.kl_coef == 0
    assert algo.off_policy_correction.cap == 2.0 and algo.off_policy_correction.level == "token"
    ok = _spec({"offPolicyCorrection": {"mode": "mis", "level": "sequence", "cap": 3, "lower": 0.5}, "klCoef": 0.1})
    assert ok.algorithm.off_policy_correction.lower == 0.5 and ok.algorithm.kl_coef == 0.1
    for bad, field in [({"offPolicyCorrection": {"mode": "clip"}}, "offPolicyCorrection.mode"),
                       ({"offPolicyCorrection": {"cap": 0.5}}, "offPolicyCorrection.cap"),
                       ({"offPolicyCorrection": {"mode": "tis", "lower": 0.5}}, "offPolicyCorrection"),
                       ({"klCoef": -1}, "klCoef")]:
        with pytest.raises(SpecError, match=field):
            _spec(bad)
    with pytest.raises(SpecError, match="spec.algorithm.klCoef.*backend megatron"):
        _spec({"klCoef": 0.1}, trainer={"backend": "megatron"})
    with pytest.raises(SpecError, match="spec.algorithm.klCoef.*sharding fsdp"):
        _spec({"klCoef": 0.1}, trainer={"sharding": "fsdp", "nodes": 2})
    # megatron runs the shared loss: the correction is accepted there
    _spec({"offPolicyCorrection": {"mode": "tis"}}, trainer={"backend": "megatron"})


def _kl_docs(n=8, seed=0):
    """Fixed documents (3 prompt + 5 completion tokens) with advantages +-1 that push the policy the same way every
    step; no sampling log-probs (on-policy: the PPO ratio is 1)."""
    from rlkube.contract import protocol

    rng = np.random.default_rng(seed)
    return [protocol.Document(rng.integers(3, 20, size=8).astype(np.int64), [(0, 3)],
                              advantage=1.0 if i % 2 == 0 else -1.0, reward=0.0) for i in range(n)]


def _k3_to(reference, trainer, docs) -> float:
    """Mean over the documents' loss tokens of k3 = exp(ref - new) - (ref - new) - 1 (KL(pi || pi_ref))."""
    batch = trainer.make_batch(docs)
    with torch.no_grad():
        new = trainer.backend.logits(batch.tokens).log_softmax(-1)[:, :-1].gather(-1, batch.tokens[:, 1:, None])[..., 0]
        ref = reference.reference_logprobs(batch.tokens)
    d = (ref - new)[batch.loss_mask]
    return float((d.exp() - d - 1).mean())


def test_reference_kl_keeps_the_policy_closer_to_the_initial_model():
    from rlkube.core.trainer import Trainer

    docs, steps = _kl_docs(), 8
    runs = {}
    for coef in (0.0, 1.0):
        torch.manual_seed(0)
        trainer = Trainer(_spec({"klCoef": coef, "maxSteps": steps, "samplesPerStep": len(docs)}))
        for _ in range(steps):
            metrics = trainer.train_step(docs)
        runs[coef] = (trainer, metrics)
    kl_trainer, kl_metrics = runs[1.0]
    assert kl_trainer.backend.reference is not None and runs[0.0][0].backend.reference is None
    assert not any(p.requires_grad for p in kl_trainer.backend.reference.parameters())
    without, with_kl = (_k3_to(kl_trainer.backend, runs[c][0], docs) for c in (0.0, 1.0))
    print(f"\nk3 KL(pi || pi_ref) on the training tokens after {steps} steps: klCoef 0 -> {without:.4f}, "
          f"klCoef 1 -> {with_kl:.4f}; step metric ref_kl {kl_metrics['ref_kl']:.4f}")
    assert without > 0.05
    assert with_kl < 0.5 * without
    # the metric is the same k3 on the step's tokens, measured before the step's update
    assert "ref_kl" in kl_metrics and "ref_kl" not in runs[0.0][1]
    assert 0 < kl_metrics["ref_kl"] <= with_kl * 1.5 + 1e-6
    assert kl_metrics["logprob_diff_abs"] == 0  # no sampling log-probs: on-policy


def test_data_parallel_reduces_the_ratio_extrema_by_min_and_max():
    """Two ranks: sums add over ranks, is_ratio_min / is_ratio_max are a min and a max (trainer.optim_step)."""
    from rlkube.contract import protocol
    from rlkube.core.trainer import Trainer
    from rlkube.core.trainer.parallel import DataParallelGroup

    class TwoRanks:  # the other rank saw the same sums, a smaller minimum and a larger maximum
        def sum_gradients(self, params, extra):
            return [2 * x for x in extra]

        def max(self, value):
            return max(value, value + 1.0)

    trainer = Trainer(_spec({"offPolicyCorrection": {"mode": "tis"}}))
    old = np.zeros(8, dtype=np.float32)
    old[3:] = -2.0
    doc = protocol.Document(np.arange(3, 11, dtype=np.int64), [(0, 3)], advantage=1.0,
                            old_log_probabilities=old, model_version=np.zeros(8, dtype=np.int64))
    single = trainer.forward_backward([doc])
    trainer.parallel = DataParallelGroup(TwoRanks())
    step = trainer.optim_step()
    assert step["loss_tokens"] == 2 * single["loss_tokens"]
    assert step["is_ratio_mean"] == pytest.approx(single["is_ratio_mean"])
    assert step["is_ratio_max"] == pytest.approx(single["is_ratio_max"] + 1.0)
    assert step["is_ratio_min"] == pytest.approx(single["is_ratio_min"] - 1.0)
