"""trainer.nodes: 2 through the chart's operator on the real node (kubelet + containerd + kube-scheduler + the
cluster DNS), data parallel and FSDP2 over a checkpoint claim both ranks write: moved here from the node agent.
Not done: the pod-template test (env, ConfigMap volume, nodeSelector)
and two ranks in one trainer pod stay on the agent (tests/e2e/test_pod_overrides.py) until a real-node version
passes: looking inside every container needs the job held mid-run, and an 8-step job ended first.
"""

from __future__ import annotations

import pytest
import specs
import yaml
from clusterjob import FULL_ORDER, MIN_MARGIN, ROOT, example, stage_names
from realnode import CORE_IMAGE, REDIS_IMAGE, ContainerRuns, PodWatch, checkpoint_claim
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
    rank1 = ContainerRuns(job.namespace, job.pod("trainer", 1), "trainer")
    rank1.start()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["trainer"]["step"] == steps
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, steps + 1)), follower.describe()
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    rank1.stop()
    # Every step is a collective of both ranks, so rank 1 took part from the first step to rank 0's finish.
    assert "rank 1/2 joined the data-parallel group" in rank1.text, rank1.describe()
    assert "rank 1 left the data-parallel group after rank 0 finished" in rank1.text, rank1.describe()
    assert follower.metrics[-1]["documents_seen"] == steps * tj["spec"]["algorithm"]["samplesPerStep"]
    pods.stop()
    order = sorted(pods.deleted_at_rv, key=pods.deleted_at_rv.get)
    trainers = {job.pod("trainer", 0), job.pod("trainer", 1)}
    at = [i for i, p in enumerate(order) if p in trainers]
    assert len(at) == 2 and at[1] == at[0] + 1, order  # deleted together, in the trainer stage
    assert stage_names(st) == FULL_ORDER


def test_fsdp_on_two_trainer_nodes_learns_and_both_ranks_write_their_shards_to_one_claim(job, real_node):
    """examples/tiny-cpu-fsdp.yaml on trainer.nodes 2: two trainer pods, one FSDP2 rank each over gloo, meet by the
    headless Service, write their shards of every checkpoint to one claim (a hostPath PersistentVolume mounted into
    both pods, written by uid 10001), stream the weights to inference bucket by bucket, and the job learns
    (clusterjob.MIN_MARGIN) and Succeeds. Requests lowered so both trainers fit this 2-CPU node beside inference."""
    steps = 40
    shared = checkpoint_claim(job.core, real_node, job.namespace, "checkpoints")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu-fsdp.yaml").read_text())
    assert doc["spec"]["algorithm"]["maxSteps"] == steps
    doc["spec"]["trainer"].pop("processesPerNode")
    job.apply(specs.with_overrides(doc, {
        "spec.image": CORE_IMAGE, "spec.redis.image": REDIS_IMAGE, "spec.trainer.nodes": 2,
        "spec.trainer.resources": {"requests": {"cpu": "250m", "memory": "1Gi"}},
        "spec.trainer.checkpoint.claimName": "checkpoints"}))
    ranks = [ContainerRuns(job.namespace, job.pod("trainer", r), "trainer") for r in (0, 1)]
    for r in ranks:
        r.start()
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    for r in ranks:
        r.stop()
    st = tj["status"]
    assert st["phase"] == "Succeeded" and st["completion"]["finalStep"] == steps, job.diagnostics()
    margin, rewards = follower.reward_margin(), follower.rewards()
    print(f"\nreal-node FSDP on 2 trainer nodes: reward first-10 {sum(rewards[:10]) / 10:.3f} last-10 "
          f"{sum(rewards[-10:]) / 10:.3f} (margin {margin})")
    assert margin is not None and margin >= MIN_MARGIN, rewards
    for rank, runs in enumerate(ranks):
        assert f"rank {rank}/2 joined the data-parallel group" in runs.text, runs.describe()
        assert "weights published bucket by bucket" in runs.text and "Traceback" not in runs.text, runs.describe()
    # Both ranks wrote their shards of the last checkpoint to the one claim, beside rank 0's HF export.
    assert list(shared.rglob(f"shards-{steps:06d}/.metadata")), sorted(str(p) for p in shared.rglob("*"))[:50]
    assert list(shared.rglob(f"step-{steps:06d}/model.safetensors"))
    assert stage_names(st) == FULL_ORDER
