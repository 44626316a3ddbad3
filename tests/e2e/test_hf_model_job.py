"""examples/qwen2-math-cpu.yaml through the operator on the test node agent (issue 9, must-show 2): a tiny random
Qwen2 with a byte-level BPE tokenizer trained in the test and a chat template, given as a host directory (the node
agent runs pods as local processes that see the host's files), on a JSONL dataset of arithmetic prompts scored by
math-verify. The job Succeeds, every step's reward is scored and reported (events and status, no reward errors),
and the checkpoint the status names is a Hugging Face directory transformers loads."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from clusterjob import ROOT
from hf_models import arithmetic_rows, write_jsonl, write_tiny_model
from rlkube.controller import names

STEPS = 6


@pytest.fixture
def host_dir():
    """A host directory the pods can see: not under /tmp, which is an emptyDir inside every pod."""
    path = Path(tempfile.mkdtemp(prefix="rlkube-e2e-hf-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_qwen2_bpe_math_job_succeeds_scores_rewards_and_checkpoints_hf(job, host_dir):
    model_dir = write_tiny_model(host_dir / "qwen2", "qwen2", "bpe", seed=0)
    dataset = write_jsonl(host_dir / "arithmetic.jsonl", arithmetic_rows(64))
    doc = yaml.safe_load((ROOT / "examples" / "qwen2-math-cpu.yaml").read_text())
    doc["spec"]["model"]["path"] = str(model_dir)
    doc["spec"]["task"]["dataset"]["path"] = str(dataset)
    doc["spec"]["algorithm"]["maxSteps"] = STEPS

    job.apply(doc)
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS and st["trainer"]["step"] == STEPS

    # math-verify scored every step's samples; the trainer reported them (events) and the operator the last (status).
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, STEPS + 1)), follower.describe()
    for m in follower.metrics:
        assert math.isfinite(m["reward_mean"]) and 0.0 <= m["reward_mean"] <= 1.0, m
        assert m["reward_errors"] == 0, m
    assert st["trainer"]["rewardMean"] == pytest.approx(follower.metrics[-1]["reward_mean"], abs=1e-4)
    print(f"\ne2e qwen2+bpe arithmetic: rewards {[round(m['reward_mean'], 3) for m in follower.metrics]}")

    # The final checkpoint, read on the host from the trainer pod's checkpoint volume (an emptyDir the agent keeps).
    inside = Path(st["completion"]["checkpoint"])
    mount = Path(tj["spec"]["trainer"]["checkpoint"].get("path", "/checkpoints"))
    pods = sorted(job.agent.state_dir.glob(f"pods/{job.namespace}_{job.name}-trainer-0_*"))
    assert len(pods) == 1, pods
    ckpt = pods[0] / "volumes" / names.VOLUME_CHECKPOINTS / inside.relative_to(mount)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.chat_template and tok("What is 3+4?")["input_ids"] == AutoTokenizer.from_pretrained(
        str(model_dir))("What is 3+4?")["input_ids"]
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
