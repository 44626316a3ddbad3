"""Policy losses against values computed by hand on small tensors (ratios chosen so the arithmetic is exact)."""

import math

import pytest
import torch

from rlkube.core.training.losses import LossConfig, policy_loss


def _logp(ratios):
    """new_logp leaf whose ratio against old_logp = 0 is exactly `ratios`."""
    return torch.tensor(ratios, dtype=torch.float64).log().requires_grad_(True)


def test_grpo_ratio_and_clipping_both_sides_by_hand():
    new = _logp([[1.5, 0.5, 1.1], [1.5, 0.5, 2.0]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = policy_loss(new, old, adv, mask, LossConfig("grpo", 0.2, 0.2))
    # A=+1: min(1.5, 1.2)=1.2 (upper clip binds), min(0.5, 0.8)=0.5, min(1.1, 1.1)=1.1
    # A=-1: min(-1.5, -1.2)=-1.5, min(-0.5, -0.8)=-0.8 (lower clip binds), third token masked
    # loss = -(1.2 + 0.5 + 1.1 - 1.5 - 0.8) / 5 loss tokens = -0.1
    assert out.loss.item() == pytest.approx(-0.1)
    m = out.stats.metrics()
    assert m["loss_tokens"] == 5
    assert m["clipped_fraction"] == pytest.approx(2 / 5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert m["kl"] == pytest.approx((2 * k3(1.5) + 2 * k3(0.5) + k3(1.1)) / 5)
    out.loss.backward()
    # d/dlogp of -r*A is -r*A; zero where the clip binds or the token is masked; / 5 tokens.
    expected = torch.tensor([[0.0, -0.5 / 5, -1.1 / 5], [1.5 / 5, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected)


def test_ppo_is_the_same_token_level_objective_with_asymmetric_clip():
    new = _logp([[1.25, 0.7]])
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    # eps_high 0.3 -> 1.25 not clipped; A>0 and r<1 -> never clipped from below
    out = policy_loss(new, torch.zeros(1, 2, dtype=torch.float64), adv, mask, LossConfig("ppo", 0.1, 0.3))
    assert out.loss.item() == pytest.approx(-(1.25 + 0.7) / 2)
    assert out.stats.clipped == 0
    # eps_high 0.2 -> 1.25 clipped to 1.2
    out = policy_loss(new, torch.zeros(1, 2, dtype=torch.float64), adv, mask, LossConfig("ppo", 0.1, 0.2))
    assert out.loss.item() == pytest.approx(-(1.2 + 0.7) / 2)
    assert out.stats.clipped == 1


def test_ratio_is_against_the_sampling_logprobs():
    # new == old everywhere -> ratio exactly 1 and the loss is -mean(A) over loss tokens
    new = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], dtype=torch.float64, requires_grad=True)
    old = new.detach().clone()
    out = policy_loss(new, old, torch.tensor([2.0, -1.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool), LossConfig())
    assert out.stats.metrics()["ratio_mean"] == pytest.approx(1.0)
    assert out.stats.metrics()["kl"] == pytest.approx(0.0)
    assert out.loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    # shifting old by log(2) halves every ratio
    out = policy_loss(new, old + math.log(2), torch.tensor([2.0, -1.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool), LossConfig())
    assert out.stats.metrics()["ratio_mean"] == pytest.approx(0.5)


def test_gspo_sequence_ratio_by_hand():
    # seq 0: token log-ratios [ln 2, 0] -> s = exp(ln2 / 2) = sqrt(2) > 1.2 -> clipped at 1.2 (A=+1)
    # seq 1: log-ratios [ln 0.9, ln 0.9, masked] -> s = 0.9, A=-1 -> min(-0.9, -0.9): not clipped
    new = _logp([[2.0, 1.0, 1.0], [0.9, 0.9, 5.0]])
    old = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, False]])
    out = policy_loss(new, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, LossConfig("gspo", 0.2, 0.2))
    # each sequence's loss counts once per loss token: (-1.2 * 2 + 0.9 * 2) / 4
    assert out.loss.item() == pytest.approx((-2.4 + 1.8) / 4)
    m = out.stats.metrics()
    assert m["ratio_mean"] == pytest.approx((2 * math.sqrt(2) + 2 * 0.9) / 4)
    assert m["clipped_fraction"] == pytest.approx(0.5)
    out.loss.backward()
    # seq 1: d/dlogp_t of 2 tokens * (-(-1) * s) / 4 = 2 * s * (1/2) / 4 = s / 4 per token; seq 0 clipped -> 0
    expected = torch.tensor([[0.0, 0.0, 0.0], [0.9 / 4, 0.9 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected)


def test_reinforce_uses_a_stop_gradient_clamped_ratio_weight():
    new = _logp([[1.5, 0.5]])
    out = policy_loss(new, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64),
                      torch.ones(1, 2, dtype=torch.bool), LossConfig("reinforce", 0.2, 0.2))
    # weights clamp(r, 0, 1.2) = [1.2, 0.5]; loss = -(ln1.5 * 2 * 1.2 + ln0.5 * 2 * 0.5) / 2
    assert out.loss.item() == pytest.approx(-(math.log(1.5) * 2.4 + math.log(0.5) * 1.0) / 2)
    assert out.stats.clipped == 1
    out.loss.backward()
    # the weight is a constant: d/dlogp = -A * w / 2
    torch.testing.assert_close(new.grad, torch.tensor([[-2.4 / 2, -1.0 / 2]], dtype=torch.float64))


def test_sft_is_cross_entropy_on_unmasked_tokens():
    new = torch.tensor([[-0.5, -1.5, -9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    out = policy_loss(new, torch.zeros_like(new), torch.tensor([0.0], dtype=torch.float64), mask, LossConfig("sft"))
    assert out.loss.item() == pytest.approx((0.5 + 1.5) / 2)
    out.loss.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[-0.5, -0.5, 0.0]], dtype=torch.float64))


@pytest.mark.parametrize("kind", ["grpo", "gspo", "reinforce", "sft"])
def test_masked_tokens_do_not_matter(kind):
    torch.manual_seed(0)
    base = -torch.rand(3, 4, dtype=torch.float64)
    old = -torch.rand(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    changed = torch.where(mask, base, base - 7.0)
    old_changed = torch.where(mask, old, old + 3.0)
    a = base.clone().requires_grad_(True)
    b = changed.clone().requires_grad_(True)
    la = policy_loss(a, old, adv, mask, LossConfig(kind))
    lb = policy_loss(b, old_changed, adv, mask, LossConfig(kind))
    assert la.loss.item() == pytest.approx(lb.loss.item())
    la.loss.backward()
    lb.loss.backward()
    torch.testing.assert_close(a.grad, b.grad)
    assert (a.grad[~mask] == 0).all()


@pytest.mark.parametrize("kind", ["grpo", "gspo", "reinforce"])
def test_micro_batches_with_the_step_normalizer_equal_one_batch(kind):
    torch.manual_seed(1)
    new = -torch.rand(4, 5, dtype=torch.float64)
    old = new + 0.3 * torch.randn(4, 5, dtype=torch.float64)
    mask = torch.rand(4, 5) > 0.3
    adv = torch.randn(4, dtype=torch.float64)
    whole = new.clone().requires_grad_(True)
    policy_loss(whole, old, adv, mask, LossConfig(kind)).loss.backward()
    parts = new.clone().requires_grad_(True)
    n = float(mask.sum())
    total = 0.0
    for sl in (slice(0, 1), slice(1, 4)):
        out = policy_loss(parts[sl], old[sl], adv[sl], mask[sl], LossConfig(kind), normalizer=n)
        out.loss.backward()
        total += out.loss.item()
    assert total == pytest.approx(policy_loss(new, old, adv, mask, LossConfig(kind)).loss.item())
    torch.testing.assert_close(whole.grad, parts.grad)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="spec.algorithm.loss"):
        LossConfig("dpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clipEpsilonLow"):
        LossConfig("grpo", clip_low=1.0)
