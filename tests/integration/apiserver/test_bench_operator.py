"""`rlkube bench operator` end to end at N=3 against the test control plane, Job controller baseline included,
so the benchmark (and the kube-controller-manager it starts) cannot silently break.

The bench runs as a user runs it (a subprocess of `python -m rlkube.cli`), with the kube-controller-manager of
the test control plane's build; it starts its own operator, fake kubelet and controller manager.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest
from support.local_cli import summary_of
from cluster.control_plane import binaries

pytestmark = pytest.mark.timeout(600)


def test_bench_operator_compares_with_the_job_controller_on_the_same_api_server(cluster, crd, api_client):
    from kubernetes import client

    kcm = binaries(build=False)["kcm"]
    env = {**os.environ, "KUBECONFIG": str(cluster), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "rlkube.cli", "bench", "operator", "-n", "3", "--json",
         "--kube-controller-manager", kcm],
        capture_output=True, text=True, env=env, timeout=540,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    (row,) = summary_of(out.stdout)
    assert row["n"] == 3
    assert 0 < row["create_to_children_p50"] <= row["create_to_children_p99"]
    assert 0 < row["finished_to_released_p50"] <= row["finished_to_released_p99"]
    assert 0 < row["job_controller_create_p50"] <= row["job_controller_create_p99"]
    assert row["create_ratio_p99"] == round(row["create_to_children_p99"] / row["job_controller_create_p99"], 2)
    assert row["teardown_ratio_p99"] == round(row["finished_to_released_p99"] / row["job_controller_create_p99"], 2)
    assert 30 < row["operator_rss_mb"] < 2000
    assert "Creating 3 Jobs of 4 pods".lower() in out.stderr.lower()

    # The baseline's namespace was deleted and waited for; its controller manager is stopped.
    namespaces = client.CoreV1Api(api_client).list_namespace().items
    assert not [ns.metadata.name for ns in namespaces if ns.metadata.name.startswith("bench-jobctl-3-")]
    running = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
               if p.info["cmdline"] and "--controllers=job" in p.info["cmdline"]]
    assert not [c for c in running if any(str(cluster) in arg for arg in c)], running
