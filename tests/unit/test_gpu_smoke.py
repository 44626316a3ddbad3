"""`python -m rlkube.bench.gpu_smoke --cpu`: the GPU smoke check's own steps (one-rank FSDP over gloo, the Trainer
API, checkpoint and resume, the native engine behind its HTTP server with an in-process weight update, the log-
prob comparison) in float32 on CPU at tiny sizes, so that the check is known to work before a GPU runs it
(README, "make gpu-smoke")."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_runs_on_cpu_and_every_check_passes(tmp_path):
    out = tmp_path / "smoke.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "rlkube.bench.gpu_smoke", "--cpu", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    result = json.loads(lines[-1])  # the last stdout line is the result
    assert json.loads(out.read_text()) == result
    assert proc.returncode == 0 and result["ok"], (result.get("failed"), result.get("error"), proc.stderr[-4000:])
    assert result["failed"] == [] and all(result["checks"].values())
    assert result["dist_backend"] == "gloo" and result["fsdp_world_size"] == 1
    assert result["backend"] == "FSDPTorchBackend" and result["dtype"] == "float32"
    assert result["steps"] >= 2 and math.isfinite(result["loss_first"]) and math.isfinite(result["loss_last"])
    assert result["loss_last"] < result["loss_first"]
    assert result["checkpoint_roundtrip_ok"] is True
    assert 0 <= result["logprob_max_abs_diff"] <= result["logprob_tolerance"]
    assert result["logprob_tokens_compared"] > 0
    assert result["train_tokens_per_s"] > 0 and result["engine_tokens_per_s"] > 0
    assert result["loss_peak_mem_bytes"] is None  # a CUDA figure only


def test_a_failed_check_exits_non_zero(tmp_path):
    # A tokenizer bigger than the model cannot work: the run fails at once, still prints its JSON line, exit 1.
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "rlkube.bench.gpu_smoke", "--cpu", "--vocab", "8"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and result["ok"] is False and "--vocab 8" in result["error"]
