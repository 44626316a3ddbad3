"""trainer.nodes: 2 through the chart's operator on the real node (kubelet + containerd + kube-scheduler + the
cluster DNS): moved here from the node agent. Not done: the pod-template test (env, ConfigMap volume, nodeSelector)
and two ranks in one trainer pod stay on the agent (tests/e2e/test_pod_overrides.py) until a real-node version
passes: looking inside every container needs the job held mid-run, and an 8-step job ended first.
"""

from __future__ import annotations

import pytest
from clusterjob import FULL_ORDER, example, stage_names
from realnode import CORE_IMAGE, REDIS_IMAGE, LogFollower, PodWatch
from waiting import wait_for

STEPS = 10


@pytest.fixture
def job(real_job):
    return real_job


def _example(**overrides) -> dict:
    return example(**{"spec.image": CORE_IMAGE, "spec.redis.image": REDIS_IMAGE, "spec.algorithm.maxSteps": STEPS,
                      **overrides})


def test_two_trainer_nodes_train_data_parallel_and_succeed(job, real_api):
    """trainer.nodes: 2: two trainer pods find each other by the headless Service name the operator gives as
    MASTER_ADDR (the cluster DNS), train as ranks 0 and 1, and go together at the trainer stage. Their requests are
    lowered so both fit the one 2-CPU node beside inference (on CPU the trainers' spread is only a preference)."""
    steps = STEPS
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    job.apply(_example(**{"spec.trainer.nodes": 2,
                          "spec.trainer.resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}))
    follower = job.follow()
    rank1 = LogFollower(job.core, job.namespace, job.pod("trainer", 1), "trainer")
    rank1.start()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["trainer"]["step"] == steps
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, steps + 1)), follower.describe()
    rank1.join(timeout=60)
    # Every step is a collective of both ranks, so rank 1 took part from the first step to rank 0's finish.
    assert "rank 1/2 joined the data-parallel group" in rank1.text, rank1.text[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in rank1.text, rank1.text[-3000:]
    assert follower.metrics[-1]["documents_seen"] == steps * tj["spec"]["algorithm"]["samplesPerStep"]
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    pods.stop()
    order = sorted(pods.deleted_at_rv, key=pods.deleted_at_rv.get)
    trainers = {job.pod("trainer", 0), job.pod("trainer", 1)}
    at = [i for i, p in enumerate(order) if p in trainers]
    assert len(at) == 2 and at[1] == at[0] + 1, order  # deleted together, in the trainer stage
    assert stage_names(st) == FULL_ORDER
