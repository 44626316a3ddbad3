"""`rlkube bench inference --json` at a tiny size, both engines, as a user runs it (a subprocess of `python -m
rlkube.cli`), so the benchmark cannot silently break: every number it reports is present and positive, and it
processes what it says (tokens counted from the replies, updates of the model's real size)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.local_cli import summary_of
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON
from support import ROOT

VLLM_PYTHON = os.environ.get(ENV_VLLM_PYTHON) or str(ROOT / ".venv-vllm" / "bin" / "python")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                       reason=f"no vLLM environment at {VLLM_PYTHON} (`make deps-vllm` builds it)"),
]


def test_bench_inference_compares_vllm_with_native_and_updates_with_raw_gloo():
    env = {**os.environ, "OMP_NUM_THREADS": "1", ENV_VLLM_PYTHON: VLLM_PYTHON}
    out = subprocess.run(
        [sys.executable, "-m", "rlkube.cli", "bench", "inference", "--json", "--seconds", "1", "--updates", "2",
         "--repeats", "3", "--concurrency", "2", "-n", "2", "--max-tokens", "4"],
        capture_output=True, text=True, env=env, timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    r = summary_of(out.stdout)
    print(json.dumps(r, indent=1))
    assert set(r["engines"]) == {"native", "vllm"}
    assert r["model_parameters"] > 0 and r["update_megabytes"] > 0
    for engine in r["engines"].values():
        for key in ("tokens_per_s", "requests_per_s", "p50_ms", "listening_s", "startup_join_s"):
            assert engine[key] > 0, key
        assert engine["requests"] >= 1
        w = engine["weight_update"]
        assert w["updates"] == 2
        for key in ("publish_s_median", "in_effect_s_median", "publish_s_per_mb", "in_effect_s_per_mb"):
            assert w[key] > 0, key
        assert w["in_effect_s_per_mb"] >= w["publish_s_per_mb"]  # in effect only after the transfer
        assert w["in_effect_s_per_mb"] * r["update_megabytes"] == pytest.approx(w["in_effect_s_median"])
    g = r["raw_gloo_broadcast"]
    assert g["repeats"] == 3 and g["round_s_median"] > 0 and g["s_per_mb"] > 0
    assert r["vllm_over_native_tokens_per_s"] > 0
