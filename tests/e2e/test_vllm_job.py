"""`engine: vllm` through the operator: the inference pod runs the vLLM image's program (`python -m
rlkube.core.inference`, handing over to rlkube.core.vllm_server), joins the trainer's weight-update group, the actors
sample from it, the job Succeeds and is torn down in order. The node agent gives a pod whose image is a vLLM image
the vLLM environment (RLKUBE_VLLM_PYTHON, tests/nodeagent/agent.py `image_env`), as that image would have it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from clusterjob import FULL_ORDER, example, stage_names

VLLM_PYTHON = os.environ.get("RLKUBE_VLLM_PYTHON") or str(Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.environ.get("RLKUBE_VLLM_PYTHON") or not os.access(VLLM_PYTHON, os.X_OK),
                       reason="RLKUBE_VLLM_PYTHON does not name the vLLM environment (`make test` sets it to "
                              ".venv-vllm/bin/python, which `make deps-vllm` builds); the node agent passes it on"),
]

STEPS = 12


def test_vllm_job_succeeds_through_the_operator(job):
    job.apply(example(**{
        "spec.inference.engine": "vllm",
        "spec.inference.image": "ghcr.io/rlkube/vllm:0.1.0-cpu",
        "spec.algorithm.maxSteps": STEPS,
        "spec.runPolicy.eventTimeoutSeconds": 600,
        "spec.teardown.gracePeriodSeconds.inference": 30,
    }))
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS
    follower.stop()
    assert follower.finished is not None and follower.finished.step == STEPS, follower.describe()
    log = job.agent.container_log(job.namespace, f"{job.name}-inference-0")
    assert "vLLM engine up" in log and f"weights version {STEPS} in effect" in log, log[-3000:]
    assert stage_names(st) == FULL_ORDER and job.order("deletion") == FULL_ORDER
    assert not job.agent_signals("SIGKILL"), "a pod needed SIGKILL in a clean run"
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
