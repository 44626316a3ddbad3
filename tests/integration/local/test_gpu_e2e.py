"""`python -m rlkube.bench.gpu_e2e --cpu` (`make gpu-e2e GPU_E2E_ARGS=--cpu`): the real pipeline colocated, the way
`make gpu-e2e` runs it on one GPU, on a tiny model here, so that it cannot rot. Its one JSON line carries every
field the GPU run reports, and every weight update the trainer announced was served with the trainer's checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

FIELDS = ("phase", "steps", "reward_first", "reward_last", "updates_published", "updates_verified",
          "checksums_verified", "samples_per_s", "train_tokens_per_s", "mfu", "update_s", "update_gb_per_s",
          "copy_gb_per_s", "peak_mem_mib", "baseline_samples_per_s", "speedup", "params", "device")


def test_gpu_e2e_runs_on_cpu_and_verifies_every_update(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "rlkube.bench.gpu_e2e", "--cpu", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    line = proc.stdout.strip().splitlines()[-1]
    print(line)
    result = json.loads(line)
    assert proc.returncode == 0 and result["ok"], proc.stderr[-3000:]
    assert json.loads(out.read_text()) == result
    assert set(FIELDS) <= set(result)
    assert (result["phase"], result["steps"], result["device"]) == ("Succeeded", 6, "cpu")
    # The initial weights and one update per step, each served with the trainer's checksum.
    assert result["updates_published"] == result["updates_verified"] == 7 and result["checksums_verified"]
    for key in ("samples_per_s", "train_tokens_per_s", "update_s", "update_gb_per_s", "copy_gb_per_s",
                "baseline_samples_per_s", "speedup"):
        assert result[key] > 0, key
    assert result["mfu"] is None and result["peak_mem_mib"] is None  # GPU-only measures
