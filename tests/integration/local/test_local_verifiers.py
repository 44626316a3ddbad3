"""`rlkube local` trains the tiny model on a verifiers (0.4.0) taskset, written here against verifiers' public API
and run unchanged (rlkube.core.actor.verifiers_env): verifiers' loader finds it by id in the actor, its @vf.reward
scores every episode, and the reward is reported every step. Real roles as processes over a real redis-server."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import yaml

from support.local_cli import local_env, run_local, step_metrics
from support import ROOT

pytest.importorskip("verifiers")  # the `agents` extra

EXAMPLE = ROOT / "examples" / "calculator-cpu.yaml"
TASKSET = textwrap.dedent('''
    """Repeat the digit the prompt names: a verifiers taskset the tiny model can learn."""
    import verifiers.v1 as vf

    __all__ = ["RepeatTaskset"]


    class RepeatData(vf.TaskData):
        answer: str = ""


    class RepeatTask(vf.Task[RepeatData]):
        @vf.reward
        async def repeated(self, task, trace) -> float:
            return float(trace.last_reply.startswith(task.answer))


    class RepeatTaskset(vf.Taskset[RepeatTask]):
        INFINITE = True

        def load(self):
            while True:
                for d in "0123":
                    yield RepeatTask(RepeatData(prompt=f"repeat {d}:", answer=d))
''')


def test_a_verifiers_taskset_trains_unchanged_with_its_reward_every_step(tmp_path):
    (tmp_path / "vf_repeat.py").write_text(TASKSET)
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "verifiers-cpu"
    doc["spec"]["task"] = {"name": "repeat", "environment": {"name": "verifiers", "params": {"taskset": "vf_repeat"},
                                                            "maxTurns": 2, "toolTimeoutSeconds": 5}}
    doc["spec"]["algorithm"].update(maxSteps=40, maxNewTokens=2)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    summary, _ = run_local(manifest, out, timeout=300, env=local_env(PYTHONPATH=pythonpath))
    print(json.dumps(summary))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 40, summary
    steps = step_metrics(out)
    assert [m["step"] for m in steps] == list(range(1, 41))
    rewards = [m["reward_mean"] for m in steps]
    assert all(0.0 <= r <= 1.0 for r in rewards) and steps[-1]["reward_errors"] == 0, rewards
    last = steps[-1]
    # Every episode went through the episode interface (one turn: the taskset has no tools) and was scored by it.
    assert last["episode_episodes"] >= 40 * 32 and last["episode_turns"] == last["episode_episodes"]
    assert last["episode_tool_errors"] == 0 and last["episode_tool_timeouts"] == 0
    first10, last10 = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    print(f"\nverifiers repeat taskset: reward first-10 {first10:.3f}, last-10 {last10:.3f}; "
          f"{last['episode_drifted']} of {last['episode_episodes']} episodes drift when re-rendered")
    # Exact match (the reply equal to the digit) was measured learning 0.144 -> 0.497 once and then stalling at
    # reward 0.003 three runs in a row (zero-advantage filtering starves it at that rate); a reply that starts with
    # the digit is scored 1: 0.166 -> 0.463.
    assert last10 >= first10 + 0.1, rewards
