"""examples/colocated-cpu.yaml through the chart's operator on the real node (kubelet + containerd): the native
engine colocated with the trainer (docs/guide/colocated.md), so ONE trainer pod runs both processes and no
inference pod exists. The chart's webhook refuses a vLLM colocation naming the field; the job's trainer pod turns
Ready once its engine joined the weight-update group (the actors start only then), its log carries both
processes, and the job Succeeds, learns and is torn down."""

from __future__ import annotations

import copy

import pytest
from support import specs
import yaml
from support import ROOT
from support.clusterjob import MIN_MARGIN
from kubernetes.client.rest import ApiException
from support.realnode import LOCAL_IMAGES
from support.waiting import wait_for

FIELD = "spec.inference.placement"


@pytest.fixture
def job(real_job):
    return real_job


def test_a_colocated_job_runs_in_one_trainer_pod_and_succeeds(job):
    doc = specs.with_overrides(yaml.safe_load((ROOT / "examples" / "colocated-cpu.yaml").read_text()), LOCAL_IMAGES)
    steps = doc["spec"]["algorithm"]["maxSteps"]
    vllm = specs.with_overrides(copy.deepcopy(doc), {"spec.inference.engine": "vllm"})  # (edits in place)
    with pytest.raises(ApiException) as refused:
        job.custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", job.namespace, "trainingjobs", vllm,
                                                   dry_run="All")
    assert refused.value.status == 422 and f"{FIELD}: colocated runs the native engine" in refused.value.body

    job.apply(doc)
    follower = job.follow()
    trainer = job.pod("trainer")

    def ready() -> str | None:
        try:
            p = job.core.read_namespaced_pod(trainer, job.namespace)
        except ApiException as exc:  # not created yet, or gone: the job ended without it ever being Ready
            return "gone" if exc.status == 404 and job.status().get("phase") in ("Succeeded", "Failed") else None
        conds = {c.type: c.status for c in p.status.conditions or []}
        return "ready" if conds.get("Ready") == "True" else None

    seen = wait_for(ready, 300, lambda: f"{trainer} Ready (its engine joined)\n{job.diagnostics()}", 0.5)
    assert seen == "ready", job.diagnostics()
    log = wait_for(lambda: (t := job.core.read_namespaced_pod_log(trainer, job.namespace))
                   and "joining weight-update epoch" in t and t, 120, "the engine's join in the trainer pod's log")
    assert "started the trainer and its colocated engine" in log and "[inference] " in log and "[trainer] " in log
    pods = [p.metadata.name for p in job.core.list_namespaced_pod(job.namespace).items]
    assert not [p for p in pods if "-inference-" in p], pods

    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["completion"]["trainerExitCode"] == 0
    follower.stop()
    margin = follower.reward_margin()
    rewards = follower.rewards()
    print(f"colocated on the real node: reward first-10 {sum(rewards[:10]) / 10:.3f} last-10 "
          f"{sum(rewards[-10:]) / 10:.3f} (margin {margin}), {len(rewards)} steps")
    assert margin is not None and margin >= MIN_MARGIN, rewards
    wait_for(lambda: not job.core.list_namespaced_pod(job.namespace).items, 180, "the job's pods torn down")
