"""`engine: vllm` through the operator: the inference pod runs the vLLM image's program (`python -m
rlkube.core.inference`, serving rlkube.core.inference.vllm_engine), joins the trainer's weight-update group, the actors
sample from it, the job Succeeds and is torn down in order. The node agent gives a pod whose image is a vLLM image
the vLLM environment (RLKUBE_VLLM_PYTHON, tests/nodeagent/agent.py `image_env`), as that image would have it.
And kill -9 of the vLLM pod's process mid-run: the container restarts in place, rejoins the weight-update group,
gets the current weights, and the job Succeeds."""

from __future__ import annotations

import os
import re
import signal

import pytest
from support import ROOT
from support.clusterjob import FULL_ORDER, POD_ORDER, example, stage_names, wait_for

VLLM_PYTHON = os.environ.get("RLKUBE_VLLM_PYTHON") or str(ROOT / ".venv-vllm/bin/python")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.environ.get("RLKUBE_VLLM_PYTHON") or not os.access(VLLM_PYTHON, os.X_OK),
                       reason="RLKUBE_VLLM_PYTHON does not name the vLLM environment (`make test` sets it to "
                              ".venv-vllm/bin/python, which `make deps-vllm` builds); the node agent passes it on"),
]

STEPS = 12


def vllm_example() -> dict:
    return example(**{
        "spec.inference.engine": "vllm",
        "spec.inference.image": "ghcr.io/rlkube/vllm:0.1.0-cpu",
        "spec.algorithm.maxSteps": STEPS,
        "spec.runPolicy.eventTimeoutSeconds": 600,
        "spec.teardown.gracePeriodSeconds.inference": 30,
    })


def served_versions(log: str) -> list[int]:
    return [int(v) for v in re.findall(r"weights version (\d+) in effect", log)]


def test_vllm_job_succeeds_through_the_operator_across_a_kill_9_of_its_vllm_pod(job):
    """One vLLM job (each costs minutes here) shows both: the job through the operator with vLLM pods, and kill -9
    of the vLLM pod's process mid-run."""
    job.apply(vllm_example())
    follower = job.follow()
    pod = f"{job.name}-inference-0"
    # Mid-run for sure: vLLM serves a version > 0 (the trainer has stepped), and the trainer is frozen while the
    # server is killed, so at least one step (and its weight update, which needs every server) is still to come.
    wait_for(lambda: any(v > 0 for v in served_versions(job.agent.container_log(job.namespace, pod))), 900,
             "vLLM serving a weights version > 0", interval=0.5)
    trainer, server = job.pid("trainer"), job.pid("inference")
    os.kill(trainer, signal.SIGSTOP)
    try:
        at_kill = follower.step
        assert at_kill < STEPS, "the trainer finished before the kill"
        os.kill(server, signal.SIGKILL)
    finally:
        os.kill(trainer, signal.SIGCONT)
    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS
    assert st["components"]["inference"]["restarts"] == 1, st["components"]
    assert len(job.uids_per_pod()[pod]) == 1  # restarted in place, not recreated
    log = job.agent.container_log(job.namespace, pod)
    first, _, restarted = log.partition("==> inference/1.log <==")
    assert restarted, f"no second run of the inference container:\n{log[-3000:]}"
    again = served_versions(restarted)
    print(f"\nvLLM killed at trainer step {at_kill}; after its restart it served versions {again}")
    # It rejoined the group and loaded the trainer's weights of that moment (not its initial ones), then followed.
    assert again and again[0] >= at_kill and again[-1] == STEPS, (at_kill, again, restarted[-3000:])
    assert "vLLM engine up" in first and "vLLM engine up" in restarted
    follower.stop()
    assert follower.finished is not None and follower.finished.step == STEPS, follower.describe()
    assert stage_names(st) == FULL_ORDER and job.order("deletion") == POD_ORDER
    assert not job.agent_signals("SIGKILL"), "a pod needed SIGKILL at teardown"
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
