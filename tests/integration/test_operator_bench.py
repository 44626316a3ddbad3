"""`rlkube bench operator` runs end to end on the session's real API server and prints the documented JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

KEYS = {"n", "create_to_children_p50", "create_to_children_p99", "finished_to_released_p50",
        "finished_to_released_p99", "operator_rss_mb"}


def test_bench_operator_json(cluster, crd):
    out = subprocess.run(
        [sys.executable, "-m", "rlkube.cli", "bench", "operator", "--json", "-n", "3", "--kubeconfig", str(cluster)],
        capture_output=True, text=True, timeout=280, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == KEYS and result["n"] == 3
    assert 0 < result["create_to_children_p50"] <= result["create_to_children_p99"]
    assert 0 < result["finished_to_released_p50"] <= result["finished_to_released_p99"]
    assert 30 < result["operator_rss_mb"] < 2000
