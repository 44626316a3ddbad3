"""`rlkube local` on a reasoning-gym task (examples/reasoning-gym-cpu.yaml): the tiny model trains on prompts from
reasoning-gym's basic_arithmetic generator, scored by its own score_answer, with the reward reported every step.
Real roles as processes over a real redis-server, as `make demo` runs them."""

from __future__ import annotations

import json

import pytest
import yaml

from support.local_cli import run_local, step_metrics
from support import ROOT

pytest.importorskip("reasoning_gym")  # the `agents` extra

EXAMPLE = ROOT / "examples" / "reasoning-gym-cpu.yaml"


def test_a_reasoning_gym_task_trains_with_its_reward_every_step(tmp_path):
    out = tmp_path / "run"
    summary, _ = run_local(EXAMPLE, out, timeout=300)
    print(json.dumps(summary))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 40, summary
    steps = step_metrics(out)
    assert [m["step"] for m in steps] == list(range(1, 41))
    rewards = [m["reward_mean"] for m in steps]
    # The scorer ran on every sample of every step (none failed) and gave more than one value: partial credit
    # for a reply that contains the sum, full credit for the sum alone.
    assert all(0.0 <= r <= 1.0 for r in rewards) and len(set(rewards)) > 1, rewards
    assert steps[-1]["reward_errors"] == 0
    print(f"\nreasoning-gym basic_arithmetic: reward first-10 {sum(rewards[:10]) / 10:.3f}, "
          f"last-10 {sum(rewards[-10:]) / 10:.3f}")


def test_an_unknown_reasoning_gym_task_fails_the_job_naming_the_field(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["task"]["reasoningGym"]["name"] = "basic_arithmetc"
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary, _ = run_local(manifest, tmp_path / "run", timeout=180, expect=1)
    assert (summary["phase"], summary["reason"]) == ("Failed", "InvalidSpec"), summary
    assert "spec.task.reasoningGym.name: unknown reasoning-gym task 'basic_arithmetc'; did you mean " \
           "basic_arithmetic" in summary["message"], summary
