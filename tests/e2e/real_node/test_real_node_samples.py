"""`rlkube samples JOB` through the API server on the real node (kubelet + containerd, the chart's operator), as a
user runs it, with only a kubeconfig (docs/design.md §5.7): while the job runs the file is read from the running
trainer (pods/exec), and once it Succeeded and its trainer pod is gone, from its checkpoint claim by a short-lived
reader pod (pods/log). Both show the step-30 samples, and they agree. The claim already holds an earlier job's rows
(steps 10 and 30 of another run): the job keeps its own steps all the same, and the readers show its rows only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.clusterjob import example
from support.realnode import LOCAL_IMAGES, hostpath_claim
from rlkube.contract import samples as contract
from support.waiting import wait_for

STEPS, EVERY, PER_STEP = 120, 10, 3


@pytest.fixture
def job(real_job):
    return real_job


def samples(job, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlkube.cli", "samples", job.name, "-n", job.namespace,
                           "--kubeconfig", str(job.node.cp.kubeconfig), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COLUMNS": "160"})


def written(path) -> list[tuple]:
    """For assertion messages: what the trainer wrote, read from the claim's directory on this machine."""
    file = path / contract.FILE
    return [(r.get("kind"), r.get("step"), r.get("run")) for r in contract.read_rows(file)] if file.exists() else []


def test_rlkube_samples_reads_a_running_job_and_a_finished_one_through_the_api_server(job, real_node):
    path = hostpath_claim(job.core, real_node, job.namespace, "checkpoints")
    # The claim outlived an earlier job, which kept steps 10 and 30 there (its checkpoints are gone): the new job
    # keeps its own steps 10 and 30, and `rlkube samples` shows its rows only.
    earlier = [{"kind": contract.TRAIN, "step": step, "run": "an-earlier-job", "prompt": "old", "reward": 0.0}
               for step in (10, 30, 30)]
    contract.BoundedLog(path / contract.FILE, 1 << 20).append(earlier)
    subprocess.run(["chown", "10001:10001", str(path / contract.FILE)], check=True)
    doc = example(**LOCAL_IMAGES, **{
        "metadata.name": "samples", "spec.algorithm.maxSteps": STEPS,
        "spec.samples": {"everySteps": EVERY, "perStep": PER_STEP},
        "spec.trainer.checkpoint": {"intervalSteps": 40, "claimName": "checkpoints"}})
    job.apply(doc)
    job.follow()
    job.wait_step(30, timeout=600)

    # Running: the trainer writes step 30's table before its metrics event; read while it trains on.
    running = samples(job, "--step", "30", "--json", "--verbose")
    assert running.returncode == 0, running.stderr + job.diagnostics()
    assert "pods/exec" in running.stderr and "3 of earlier jobs on the same volume left out" in running.stderr, \
        running.stderr
    rows = json.loads(running.stdout)
    assert [r["step"] for r in rows] == [30] * PER_STEP, (
        f"{rows}\nstderr: {running.stderr}\non the host: {written(path)}\n{job.follower.describe()}\n"
        f"{job.diagnostics()}")
    assert {r["run"] for r in rows} == {job.get()["metadata"]["uid"]}, rows  # the job's own run
    for r in rows:
        assert r["kind"] == contract.TRAIN and r["finish_reason"] in contract.FINISH_REASONS and r["group"], r
        assert r["prompt"] and isinstance(r["reward"], float) and 0 <= r["lag"] <= 2, r
    table = samples(job, "--step", "30")
    assert table.returncode == 0, table.stderr
    assert sum(line.startswith("│ train ") and " 30 " in line for line in table.stdout.splitlines()) >= PER_STEP, \
        table.stdout

    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    assert tj["status"]["phase"] == "Succeeded", job.diagnostics()
    wait_for(lambda: not [p for p in job.core.list_namespaced_pod(job.namespace).items
                          if p.metadata.name == job.pod("trainer")], 120, "the trainer pod deleted")

    # Finished: the trainer pod is gone; the claim holds the file, read by a reader pod that is deleted after.
    done = samples(job, "--json", "--verbose")
    assert done.returncode == 0, done.stderr + job.diagnostics()
    assert "reader pod" in done.stderr, done.stderr
    every = json.loads(done.stdout)
    assert sorted({r["step"] for r in every}) == list(range(EVERY, STEPS + 1, EVERY))
    assert [r for r in every if r["step"] == 30] == rows  # the same rows, appended to, never rewritten
    on_host = list(contract.read_rows(path / contract.FILE))
    assert on_host == earlier + every  # appended beside the earlier job's rows
    wait_for(lambda: not [p for p in job.core.list_namespaced_pod(job.namespace).items
                          if p.metadata.name.endswith("-samples-reader")], 60, "the reader pod deleted")
    print(f"\nreal-node samples: step 30 read from the running trainer and, finished, from its claim: "
          f"{len(every)} rows, {(path / contract.FILE).stat().st_size} bytes")
