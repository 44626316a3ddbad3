"""Group-relative advantages against values computed by hand."""

import math

import pytest

from rlkube.core.preprocessor.advantages import group_advantages, leave_one_out, mean_std


def test_leave_one_out_by_hand():
    # r = [1, 0, 0, 1]: the baseline of a 1 is mean(0, 0, 1) = 1/3, of a 0 it is mean(1, 0, 1) = 2/3.
    assert leave_one_out([1.0, 0.0, 0.0, 1.0]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # r = [0.2, 0.5, 0.8]: 0.2 - 0.65 = -0.45, 0.5 - 0.5 = 0, 0.8 - 0.35 = 0.45
    assert leave_one_out([0.2, 0.5, 0.8]) == pytest.approx([-0.45, 0.0, 0.45])


def test_mean_std_by_hand():
    # mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-4)
    expected = 0.5 / 0.5001
    assert mean_std([1.0, 0.0, 0.0, 1.0]) == pytest.approx([expected, -expected, -expected, expected])
    # [1, 2, 3, 6]: mean 3, var (4+1+0+9)/4 = 3.5
    s = math.sqrt(3.5) + 1e-4
    assert mean_std([1.0, 2.0, 3.0, 6.0]) == pytest.approx([-2 / s, -1 / s, 0.0, 3 / s])


def test_equal_rewards_give_zero_advantage():
    for estimator in ("leave-one-out", "mean-std"):
        assert group_advantages([0.7] * 5, estimator) == pytest.approx([0.0] * 5)


def test_partial_and_singleton_groups():
    # A group of 2 out of an expected 8 still compares the two it has.
    assert group_advantages([0.5, 1.0], "leave-one-out") == pytest.approx([-0.5, 0.5])
    assert group_advantages([0.5, 1.0], "mean-std") == pytest.approx([-0.25 / 0.2501, 0.25 / 0.2501])
    for estimator in ("leave-one-out", "mean-std"):
        assert group_advantages([0.9], estimator) == [0.0]
        assert group_advantages([0.9], estimator, normalize=True) == [0.0]
        assert group_advantages([], estimator) == []


def test_leave_one_out_normalized_by_group_std():
    # LOO [2/3, -2/3, -2/3, 2/3] divided by std 0.5 (+1e-4)
    a = 2 / 3 / 0.5001
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "leave-one-out", normalize=True) == pytest.approx([a, -a, -a, a])


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="spec.algorithm.advantage"):
        group_advantages([1.0, 0.0], "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([1.0, float("nan")])
