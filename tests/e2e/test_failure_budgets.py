"""Failure budgets end to end: a component that cannot run ends the job, with its own words in the status.

The inference pod here asks for `engine: vllm` in an environment without vLLM: it exits 1 at start, every time,
and the node agent restarts it in place (restartPolicy OnFailure, with kubelet's back-off). Past
`runPolicy.componentBackoffLimit` the operator fails the job, naming the component, its exit code and the end
of its log (the pod's termination message, FallbackToLogsOnError), and tears everything down in order.
"""

from __future__ import annotations

import importlib.util

import pytest
from clusterjob import FULL_ORDER, example, stage_names

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="needs an image without vLLM")


def test_crash_looping_inference_fails_the_job_within_its_budget(job):
    budget = 2
    job.apply(example(**{"spec.inference.engine": "vllm", "spec.runPolicy.componentBackoffLimit": budget}))
    tj = job.wait_phase(("Succeeded", "Failed"), 300)
    st = tj["status"]
    assert st["phase"] == "Failed" and st["reason"] == "ComponentBackoffLimitExceeded", job.diagnostics()
    failed = next(c for c in st["conditions"] if c["type"] == "Failed")
    message = failed["message"]
    assert f"inference failed {budget + 1} time(s); componentBackoffLimit is {budget}" in message, message
    assert f"{job.name}-inference-0 (exit code 1)" in message, message
    assert "vllm is not installed" in message, message  # the role's own words, from its termination message
    assert st["components"]["inference"]["restarts"] == budget + 1
    assert stage_names(st) == FULL_ORDER
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
