"""The built-in tasks are learnable by the tiny model of examples/tiny-cpu.yaml with our own pieces end to end:
task -> torch sampling -> RolloutGroup -> preprocessor's documents -> Trainer.train_step (grpo, Adam).

Fixed seeds; the margins asserted are far below what these seeds reach (see the numbers in the asserts), so the
test is not luck, and a broken loss, sign, mask or advantage makes it fail (the reward stays flat or drops).
reverse-digits learns through partial credit; repeat-digit under a plain exact-match reward.
"""

from __future__ import annotations

import pytest
from support.learning_run import assert_reward_rose, learning_run, tiny_cpu_spec
from rlkube.api.task import TaskSpec


@pytest.mark.parametrize("seed", [0, 1])
def test_reverse_digits_reward_rises_in_40_steps(seed):
    rewards = learning_run(tiny_cpu_spec(loss="grpo"), seed, steps=40)
    # Measured with these seeds: first-10 ~0.07, last-10 >= 0.25. Assert a margin of 0.10 and a 2x ratio.
    assert_reward_rose(rewards, f"seed {seed}")


@pytest.mark.parametrize("seed", [0, 1])
def test_repeat_digit_exact_match_reward_rises_from_scratch(seed):
    # Exact match, no partial credit: one completion token that must be the digit the prompt names, from four.
    spec = tiny_cpu_spec(loss="grpo", maxNewTokens=1)
    spec.task = TaskSpec(name="repeat-digit", params={"digits": "0123"})
    rewards = learning_run(spec, seed, steps=100)
    # Measured with these seeds: first-10 0.034 / 0.056, last-10 0.475 / 0.200 (a random digit of the four scores
    # 0.25, so the policy first learns to answer with a digit, then which one).
    assert_reward_rose(rewards, f"seed {seed}")
