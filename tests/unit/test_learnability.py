"""The built-in task is learnable by the tiny model of examples/tiny-cpu.yaml with our own pieces end to end:
task -> torch sampling -> RolloutGroup -> preprocessor's documents -> Trainer.train_step (grpo, Adam).

Fixed seeds; the margins asserted are far below what these seeds reach (see the numbers in the asserts), so the
test is not luck, and a broken loss, sign, mask or advantage makes it fail (the reward stays flat or drops).
"""

from __future__ import annotations

import pytest
from learning_run import assert_reward_rose, learning_run, tiny_cpu_spec


@pytest.mark.parametrize("seed", [0, 1])
def test_reverse_digits_reward_rises_in_40_steps(seed):
    rewards = learning_run(tiny_cpu_spec(loss="grpo"), seed, steps=40)
    # Measured with these seeds: first-10 ~0.07, last-10 >= 0.25. Assert a margin of 0.10 and a 2x ratio.
    assert_reward_rose(rewards, f"seed {seed}")
