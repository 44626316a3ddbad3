"""`rlkube local` on multi-turn, tool-using episodes (spec.task.environment): the tiny model learns the built-in
calculator environment (examples/calculator-cpu.yaml), and an environment factory that raises fails the job
naming the field. Real roles as processes over a real redis-server, as `make demo` runs them."""

from __future__ import annotations

import json
import os
import textwrap
import time

import yaml
from support.local_cli import local_env, run_local, step_metrics
from support import ROOT

EXAMPLE = ROOT / "examples" / "calculator-cpu.yaml"
# Measured (examples/calculator-cpu.yaml, 60 steps, 26-30 s on 2 cores) with seeds 0-4: first-10 0.049-0.060,
# last-10 0.327-0.352; tool calls per episode 0.14-0.21 over the first 10 steps, 1.02-1.34 over the last 10. The
# bounds keep a third of that gain as headroom: the roles race each other, so the run is not bit-reproducible.
MIN_MARGIN = 0.10


def test_tiny_model_learns_the_calculator_tool_task(tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    summary, _ = run_local(EXAMPLE, out, timeout=300)
    wall = time.monotonic() - t0
    print(json.dumps(summary))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 60, summary
    assert summary["reward_last"] - summary["reward_first"] >= MIN_MARGIN, summary
    assert wall < 300, f"took {wall:.0f}s"  # ~26 s on an idle 2-core machine; the bound allows a loaded one
    metrics = step_metrics(out)
    last = metrics[-1]
    # The episode counts reach the trainer's metrics: every written episode counted, multi-turn ones among them.
    assert last["episode_episodes"] >= 60 * 32 * 0.5 and last["episode_turns"] > last["episode_episodes"]
    assert last["episode_tool_calls"] == last["episode_turns"] - last["episode_episodes"]
    assert last["episode_tool_errors"] == 0 and last["episode_tool_timeouts"] == 0
    # The calculator runs no snippet and answers at once: nothing refused, no episode near its time limit.
    assert last["episode_sandbox_refusals"] == 0 and last["episode_timed_out"] == 0
    # Plain-text prompts: a reply that stopped on <eos> before a tool call loses it when the text is re-rendered
    # (tests/unit/test_episodes.py shows which episodes count); reported, never trained on.
    assert 0 <= last["episode_drifted"] <= last["episode_episodes"]
    print(f"\ncalculator: {last['episode_drifted']} of {last['episode_episodes']} episodes drift when re-rendered")
    calls = [m["tool_calls_per_episode"] for m in metrics if "tool_calls_per_episode" in m]
    # The policy learns to call the tool: a random one calls it in a few episodes of a hundred.
    assert sum(calls[-10:]) / 10 > sum(calls[:10]) / 10 + 0.3, calls


def test_an_environment_factory_that_raises_fails_the_job_naming_the_field(tmp_path):
    (tmp_path / "broken_env.py").write_text(textwrap.dedent("""
        def make(**params):
            raise RuntimeError("the sandbox is not installed")
    """))
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["task"]["environment"] = {"entryPoint": "broken_env:make"}
    doc["spec"]["algorithm"]["maxSteps"] = 5
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    summary, _ = run_local(manifest, tmp_path / "run", timeout=180, expect=1, env=local_env(PYTHONPATH=pythonpath))
    assert (summary["phase"], summary["reason"]) == ("Failed", "InvalidSpec"), summary
    assert "spec.task.environment.entryPoint: the environment factory raised RuntimeError: the sandbox is not " \
           "installed" in summary["message"], summary


TURN_REWARD_ENV = '''
from rlkube.core.actor.calculator import Calculator, CalculatorEpisode
from rlkube.core.actor.episodes import Turn


class Episode(CalculatorEpisode):
    def respond(self, reply):
        answer = super().respond(reply)
        return Turn(answer, reward=0.05) if answer else None  # a little credit for each tool call


class WithTurnRewards(Calculator):
    def start(self, prompt):
        return Episode(prompt.meta["question"], prompt.meta["answer"], self.call_credit, self.kind_credit)


def make(**params):
    return WithTurnRewards(**params)
'''


def test_fractional_per_turn_rewards_train_to_succeeded_with_their_mean_reported(tmp_path):
    # A group whose episodes called no tool has no per-turn reward, one that did has 0.05s: the tiny model calls the
    # calculator in a few episodes of a hundred at first, so the job sees both kinds from its first steps, in
    # whatever order the actors write them (the actors' counters are typed by name, rlkube.contract.counters).
    (tmp_path / "turn_reward_env.py").write_text(TURN_REWARD_ENV)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "turn-rewards"
    environment = doc["spec"]["task"]["environment"]
    del environment["name"]
    environment["entryPoint"] = "turn_reward_env:make"
    doc["spec"]["algorithm"]["maxSteps"] = 12
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    out = tmp_path / "run"
    summary, _ = run_local(manifest, out, timeout=240, env=local_env(PYTHONPATH=pythonpath))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 12, summary
    metrics = step_metrics(out)
    last = metrics[-1]
    rewarded = [m["turn_reward_mean"] for m in metrics if "turn_reward_mean" in m]
    # every rewarded turn is a tool call worth 0.05, and some steps' episodes called the tool, some not
    assert rewarded and all(abs(r - 0.05) < 1e-9 for r in rewarded), rewarded
    # (a call in an episode's last allowed turn is rewarded but never answered: truncated, not a tool call)
    assert 0 < last["episode_tool_calls"] <= last["episode_turn_rewards"] <= last["episode_turns"], last
    assert last["episode_tool_calls"] < last["episode_episodes"], last  # episodes without a tool call too
    # the status subset `rlkube local` shows (as a TrainingJob's status.agent) carries them
    agent = summary["agent"]
    assert agent["turn_reward_mean"] == 0.05 and agent["tool_calls"] == last["episode_tool_calls"], agent
    assert agent["episodes"] == last["episode_episodes"], agent
