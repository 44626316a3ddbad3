"""Group-relative advantages (GRPO-style): each sample's reward compared with the other samples of its prompt.

Pure functions on lists of floats so the preprocessor, the synchronous benchmark and the tests share them.
Groups may be partial (an actor lost samples, or a group was cut short): the estimators only use the samples
that are there, and a group of one has nothing to compare with, so its advantage is 0 (docs/references.md §6.10).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

Estimator = Literal["leave-one-out", "mean-std"]
STD_EPS = 1e-4


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: Sequence[float]) -> float:
    """Population std (divide by n), as GRPO implementations use for the group normaliser."""
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def leave_one_out(rewards: Sequence[float]) -> list[float]:
    """A_i = r_i - mean(r_j, j != i). Unbiased baseline: a sample's own reward is not in its baseline."""
    n = len(rewards)
    if n <= 1:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def mean_std(rewards: Sequence[float]) -> list[float]:
    """A_i = (r_i - mean) / (std + 1e-4): the original GRPO estimator."""
    n = len(rewards)
    if n <= 1:
        return [0.0] * n
    m, s = _mean(rewards), _std(rewards)
    return [(r - m) / (s + STD_EPS) for r in rewards]


def group_advantages(rewards: Sequence[float], estimator: Estimator = "leave-one-out", normalize: bool = False) -> list[float]:
    """Advantages of one group. `normalize` divides by the group's reward std (+1e-4); mean-std already does."""
    for i, r in enumerate(rewards):
        if not math.isfinite(r):
            raise ValueError(f"reward {i} of the group is not finite: {r!r}")
    if estimator == "leave-one-out":
        adv = leave_one_out(rewards)
        if normalize and len(rewards) > 1:
            s = _std(rewards)
            adv = [a / (s + STD_EPS) for a in adv]
        return adv
    if estimator == "mean-std":
        return mean_std(rewards)
    raise ValueError(f"spec.algorithm.advantage: unknown estimator {estimator!r} (leave-one-out, mean-std)")
