"""examples/calculator-cpu.yaml through the operator on the test node agent: multi-turn, tool-using episodes
(spec.task.environment) with evaluation while training (spec.evaluation), the same job `rlkube local` runs in
tests/integration/test_local_episodes.py.

The job Succeeds and learns (the reward margin of the local test's bound); the trainer's metrics events carry the
episode counts (turns above episodes, tool calls = turns - episodes, no tool errors or timeouts) and tool calls per
episode rise; actor 0's evaluation events reach the job's status (`trainer.evalRewardMean`, `evalVersion` on a
multiple of everyVersions), read by the operator from the same stream as the trainer's events."""

from __future__ import annotations

import yaml
from clusterjob import ROOT

MIN_MARGIN = 0.10  # tests/integration/test_local_episodes.py: measured 0.27-0.30 over 60 steps with seeds 0-4
EVERY = 20


def test_calculator_job_learns_through_the_operator_and_reports_its_evaluation(job):
    doc = yaml.safe_load((ROOT / "examples" / "calculator-cpu.yaml").read_text())
    doc["spec"]["evaluation"] = {"everyVersions": EVERY, "prompts": 8}
    steps = doc["spec"]["algorithm"]["maxSteps"]

    job.apply(doc)
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    follower.stop()

    metrics = follower.metrics
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), follower.describe()
    margin = follower.reward_margin()
    assert margin is not None and margin >= MIN_MARGIN, [round(r, 3) for r in follower.rewards()]
    last = metrics[-1]
    assert last["episode_episodes"] >= steps * 32 * 0.5 and last["episode_turns"] > last["episode_episodes"]
    assert last["episode_tool_calls"] == last["episode_turns"] - last["episode_episodes"]
    assert last["episode_tool_errors"] == 0 and last["episode_tool_timeouts"] == 0
    calls = [m["tool_calls_per_episode"] for m in metrics if "tool_calls_per_episode" in m]
    assert len(calls) >= 20 and sum(calls[-10:]) > sum(calls[:10]), calls

    trainer = st["trainer"]
    assert trainer["evalVersion"] % EVERY == 0 and trainer["evalVersion"] >= EVERY, trainer
    assert 0.0 <= trainer["evalRewardMean"] <= 1.0, trainer
    print(f"\ne2e calculator: reward margin {margin:.3f}, tool calls per episode {calls[0]:.2f} -> {calls[-1]:.2f}, "
          f"eval reward {trainer['evalRewardMean']:.3f} at version {trainer['evalVersion']}")
