"""Pods through the chart's operator on the real node (kubelet + containerd + kube-scheduler + the cluster DNS),
moved here from the node agent:
- trainer.nodes: 2, data parallel, and FSDP2 over a checkpoint claim both ranks write;
- `trainer.processesPerNode: 2` on CPU: ONE trainer pod whose launcher runs ranks 0 and 1;
- pod templates: every role's template (env, a ConfigMap volume mounted read-only, a nodeSelector) waits
  Unschedulable (kube-scheduler's verdict) until the Node gets the label, then runs: a shell inside each running
  container sees the variable and the volume's file and no ServiceAccount token; every pod as the API server stored
  it passes the security assertion (automountServiceAccountToken false, no token volume); the Redis NetworkPolicy
  exists while the job runs; the Redis password is in no status, Event, the operator's log or any container's log.
"""

from __future__ import annotations

import json

import pytest
from support import specs
import yaml
from support import ROOT
from support.clusterjob import FULL_ORDER, MIN_MARGIN, example, secret_password, stage_names
from kubernetes import client
from support.pod_security import assert_hardened_pod
from support.realnode import (LOCAL_IMAGES, OPERATOR_NS, ContainerRuns, PodWatch, exec_in, hostpath_claim, logs,
                      operator_pod)
from support.waiting import wait_for

from rlkube.controller.manifests import names

STEPS = 10


@pytest.fixture
def job(real_job):
    return real_job


def _example(**overrides) -> dict:
    return example(**{**LOCAL_IMAGES, "spec.algorithm.maxSteps": STEPS,
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
    shared = hostpath_claim(job.core, real_node, job.namespace, "checkpoints")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu-fsdp.yaml").read_text())
    assert doc["spec"]["algorithm"]["maxSteps"] == steps
    doc["spec"]["trainer"].pop("processesPerNode")
    job.apply(specs.with_overrides(doc, {
        **LOCAL_IMAGES, "spec.trainer.nodes": 2,
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


def test_two_local_ranks_inside_one_trainer_pod(job, real_api):
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    job.apply(_example(**{"spec.trainer.processesPerNode": 2}))
    follower = job.follow()
    trainer = ContainerRuns(job.namespace, job.pod("trainer"), "trainer")
    trainer.start()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS and st["completion"]["trainerExitCode"] == 0
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, STEPS + 1)), follower.describe()
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    trainer.stop()
    pods.stop()
    # One trainer pod (one container, the launcher), run once, two ranks in it.
    assert {p for p in pods.uids if "-trainer-" in p} == {job.pod("trainer")}, sorted(pods.uids)
    assert len(trainer.runs) == 1, trainer.describe()
    log = trainer.text
    assert "node 0: started ranks [0, 1]" in log, trainer.describe()
    for rank in (0, 1):
        assert f"[rank {rank}] " in log and f"rank {rank}/2 joined the data-parallel group" in log, trainer.describe()
        assert f"rank {rank} exited 0" in log, trainer.describe()
    assert "rank 1 left the data-parallel group after rank 0 finished" in log, trainer.describe()
    assert follower.metrics[-1]["documents_seen"] == STEPS * tj["spec"]["algorithm"]["samplesPerStep"]
    assert stage_names(st) == FULL_ORDER


POOL_LABEL = "e2e.rlkube.io/pool"
ROLES = ("redis", "trainer", "inference", "preprocessor", "actor")
# Printed by a shell inside each container, one key=value per line (spaces in the file's text made underscores).
SEES = ('echo "greeting=$GREETING"; echo "home=$HOME"; echo "index=$RLKUBE_INDEX"; '
        'echo "note=$(tr \' \' _ < /extra/note.txt)"; '
        'if [ -e /var/run/secrets/kubernetes.io/serviceaccount ]; then echo token=mounted; else echo token=none; fi')


def _sees(core, namespace: str, pod: str, container: str) -> dict[str, str]:
    out = exec_in(core, namespace, pod, container, SEES)
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _running(core, namespace: str, pod: str) -> bool:
    try:
        p = core.read_namespaced_pod(pod, namespace)
    except client.ApiException:
        return False
    return p.status.phase == "Running" and all(cs.state.running for cs in p.status.container_statuses or [])


def test_templates_env_volume_and_node_selector_run_on_the_labelled_node(job, real_api, real_node):
    core, ns = job.core, job.namespace
    pool = ns  # unique per test: the session's node may carry labels of earlier tests
    core.create_namespaced_config_map(ns, {"metadata": {"name": "extra-files"},
                                           "data": {"note.txt": "mounted from a template volume"}})
    manifest = example(**{**LOCAL_IMAGES})
    for role in ROLES:
        manifest["spec"][role]["template"] = {
            "metadata": {"labels": {"team": "rl-e2e"}},
            "spec": {
                "nodeSelector": {POOL_LABEL: pool},
                "volumes": [{"name": "extra", "configMap": {"name": "extra-files"}}],
                "containers": [{"name": role, "env": [{"name": "GREETING", "value": f"hello from {role}"}],
                                "volumeMounts": [{"name": "extra", "mountPath": "/extra", "readOnly": True}]}],
            },
        }
    name = manifest["metadata"]["name"]  # job.pod() knows the name once the job is applied; the logs start before
    logs_of = {role: ContainerRuns(ns, names.pod_name(name, role), role) for role in ROLES}
    for runs in logs_of.values():
        runs.start()
    job.apply(manifest)

    # No node has the label yet: kube-scheduler leaves the first pod (Redis) Unschedulable.
    def unschedulable():
        try:
            p = core.read_namespaced_pod(job.pod("redis"), ns)
        except client.ApiException:
            return None
        cond = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
        return cond if cond is not None and cond.status == "False" and cond.reason == "Unschedulable" else None

    cond = wait_for(unschedulable, 120, lambda: f"{job.pod('redis')} Unschedulable\n{job.diagnostics()}", 0.5)
    assert "node" in cond.message, cond.message
    assert not job.core.read_namespaced_pod(job.pod("redis"), ns).spec.node_name
    core.patch_node(real_node.name, {"metadata": {"labels": {POOL_LABEL: pool}}})
    try:
        follower = job.follow()
        password = secret_password(core.read_namespaced_secret(names.secret_name(job.name), ns))
        assert password
        policy = client.NetworkingV1Api(job.api_client).read_namespaced_network_policy(
            names.network_policy_name(job.name), ns)
        assert policy.spec.pod_selector.match_labels == names.role_selector(job.name, "redis")

        # A shell inside each running container sees the template's variable and volume.
        for role in ROLES:
            pod = job.pod(role)
            wait_for(lambda pod=pod: _running(core, ns, pod), 180, lambda: f"{pod} running\n{job.diagnostics()}", 0.5)
            sees = _sees(core, ns, pod, role)
            assert sees.get("greeting") == f"hello from {role}", (role, sees)
            assert sees.get("note") == "mounted_from_a_template_volume", (role, sees)
            # No role talks to the API server: the ServiceAccount admission plugin (on here) mounted no token.
            assert sees.get("token") == "none", (role, sees)
            if role != "redis":
                assert sees.get("home") == "/tmp" and sees.get("index") == "0", (role, sees)
            # What the API server stored: the merged pod, hardened, with the template's placement and labels.
            stored = job.api_client.sanitize_for_serialization(core.read_namespaced_pod(pod, ns))
            assert stored["spec"]["nodeSelector"] == {POOL_LABEL: pool}, stored["spec"]
            assert stored["spec"]["nodeName"] == real_node.name
            assert stored["metadata"]["labels"]["team"] == "rl-e2e"
            assert {"name": "GREETING", "value": f"hello from {role}"} in stored["spec"]["containers"][0]["env"]
            assert_hardened_pod(stored, manifest["spec"])
        tj = job.wait_phase(("Succeeded", "Failed"), 600)
    finally:
        core.patch_node(real_node.name, {"metadata": {"labels": {POOL_LABEL: None}}})
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    follower.stop()
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    assert stage_names(st) == FULL_ORDER

    # No Secret value in status, Events, the operator's log or any container's log.
    for runs in logs_of.values():
        runs.stop()
    assert all(runs.text for runs in logs_of.values()), {r: runs.describe() for r, runs in logs_of.items()}
    events = core.list_namespaced_event(ns)
    assert events.items, "the operator posts Events"
    op = operator_pod(core)
    haystacks = {"status": json.dumps(st), "events": json.dumps(job.api_client.sanitize_for_serialization(events)),
                 "operator log": logs(core, OPERATOR_NS, op.metadata.name, tail=None),
                 **{f"{role} log": runs.text for role, runs in logs_of.items()}}
    assert len(haystacks["operator log"]) > 1000, haystacks["operator log"]
    for where, text in haystacks.items():
        assert password not in text, f"the Redis password shows in {where}"
