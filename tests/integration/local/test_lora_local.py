"""`rlkube local examples/lora-cpu.yaml` (docs/design.md §6): a LoRA job learns on CPU with the roles as processes,
its inference server receiving the adapter alone after every step, and ends with a PEFT adapter checkpoint; a
restarted trainer whose adapter file was deleted fails the job at once (exit 78, ConfigError) naming the path.

The learning rate is examples/tiny-cpu.yaml's (0.003), not raised: the tiny random model learns reverse-digits
mostly through its output layer, so the example adapts lm_head too. With the default targets (the decoder's
linear layers only) the reward stayed at ~0.07 over 40 steps at every rate tried (0.003 to 0.1, rank 8 and 16),
while with lm_head added it rises as full-weight training does (in-process, seed 0: 0.052 -> 0.259)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.local_cli import start_local, summary_of
import yaml
from test_local_runner import ORDER, _leftovers, _role_processes, _wait_for_step
from support import ROOT

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "lora-cpu.yaml"
# Measured: first-10 0.046, last-10 0.229 (one run); tests/integration/local/test_local_runner.py asserts the same
# margin for full-weight training.
MIN_MARGIN = 0.10


def test_lora_job_learns_with_adapter_only_updates(tmp_path):
    out = tmp_path / "run"
    proc = start_local(str(EXAMPLE), "--json", "--output-dir", str(out))
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    print(json.dumps(summary))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 40
    assert summary["reward_last"] - summary["reward_first"] >= MIN_MARGIN, summary
    assert summary["reward_last"] >= 2 * summary["reward_first"], summary
    final = Path(summary["checkpoint"])
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= {p.name for p in final.iterdir()}
    updates = [float(m.group(1)) + float(m.group(2)) for m in re.finditer(
        r"adapter version \d+ in effect \(checksum \S+, transfer ([\d.]+)s, load ([\d.]+)s\)",
        (out / "logs" / "inference-0.log").read_text())]
    assert len(updates) == 41  # version 0 at start, then one per step
    print(f"engine adapter updates: median {sorted(updates)[len(updates) // 2] * 1e3:.0f} ms, "
          f"max {max(updates) * 1e3:.0f} ms")
    assert summary["teardown"] == ORDER
    assert not _leftovers(out)


def test_restarted_trainer_without_its_adapter_fails_the_job_naming_the_path(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["algorithm"]["maxSteps"] = 30
    doc["spec"]["trainer"]["checkpoint"]["intervalSteps"] = 5
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    proc = start_local(str(manifest), "--json", "--output-dir", str(out))
    _wait_for_step(out, 6, proc)
    actors = _role_processes(out, "actor")
    for a in actors:
        a.suspend()
    try:
        (trainer,) = _role_processes(out, "trainer")
        trainer.suspend()  # no checkpoint written after the adapters are deleted
        deleted = sorted((out / "checkpoints").glob("step-*/adapter_model.safetensors"))
        assert deleted
        for f in deleted:
            f.unlink()
        trainer.kill()
        trainer.wait(30)
    finally:
        for a in actors:
            a.resume()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    summary = summary_of(stdout)
    print(json.dumps(summary))
    assert summary["phase"] == "Failed", summary
    assert "spec.trainer.lora" in summary["message"] and str(deleted[-1]) in summary["message"], summary
    assert "missing" in summary["message"], summary
    assert summary["restarts"]["trainer"] == 1, summary
    assert summary["teardown"] == ORDER
    assert not _leftovers(out)
