"""Pod templates and trainer ranks through the chart's operator on the real node (kubelet + containerd +
kube-scheduler), where the real parts enforce what the template asks: moved here from the node agent.

- A job whose every role carries a template (env, a ConfigMap volume mounted read-only, a nodeSelector) waits
  Unschedulable (kube-scheduler's words) until the node gets the label, then runs: inside each running container
  (exec through the kubelet) the variable and the volume's file are there; every pod as the API server stored it
  passes the security assertion; the Redis NetworkPolicy exists while the job runs; the Redis password is in no
  status, Event, operator log or pod log.
  The same job has `trainer.processesPerNode: 2`: ONE trainer pod whose launcher runs ranks 0 and 1 (one job for
  both: each costs about a minute here).
- `trainer.nodes: 2`: two trainer pods train data parallel.
"""

from __future__ import annotations

import json

import pytest
from clusterjob import FULL_ORDER, example, secret_password, stage_names
from kubernetes import client
from pod_security import assert_hardened_pod
from realnode import CORE_IMAGE, REDIS_IMAGE, LogFollower, PodWatch, exec_in, logs, operator_pod
from rlkube.controller import names
from waiting import wait_for

STEPS = 8
POOL_LABEL = "e2e.rlkube.io/pool"
ROLES = ("trainer", "inference", "actor", "preprocessor", "redis")


@pytest.fixture
def job(real_job):
    return real_job


def _example(**overrides) -> dict:
    return example(**{"spec.image": CORE_IMAGE, "spec.redis.image": REDIS_IMAGE, "spec.algorithm.maxSteps": STEPS,
                      **overrides})


def _pod_name(job, role: str) -> str:
    return f"{job.name}-redis" if role == "redis" else job.pod(role)


def _look_inside(job, real_node, real_api, manifest: dict, pool: str) -> dict[str, str]:
    """Each role's container from inside (exec through the kubelet): the template's variable and volume file; the
    pod as stored, hardened and placed; the container's log so far."""
    core = job.core
    logs_seen = {}
    for role in ROLES:
        pod = _pod_name(job, role)
        job.container(role)
        said = exec_in(core, job.namespace, pod, role,
                       "cat /extra/note.txt; echo; tr '\\0' '\\n' < /proc/1/environ | grep -E '^(GREETING|HOME)='")
        assert "mounted from a template volume" in said, (role, said)
        if role != "redis":  # redis-server rewrites its process title over its environment block
            assert f"GREETING=hello from {role}" in said and "HOME=/tmp" in said, (role, said)
        stored = real_api.sanitize_for_serialization(core.read_namespaced_pod(pod, job.namespace))
        assert stored["spec"]["nodeSelector"] == {POOL_LABEL: pool} and stored["spec"]["nodeName"] == real_node.name
        assert stored["metadata"]["labels"]["team"] == "rl-e2e"
        assert_hardened_pod(stored, manifest["spec"])
        logs_seen[role] = logs(core, job.namespace, pod, role, tail=None)
    return logs_seen


def test_env_volume_and_node_selector_overrides_run_on_the_labelled_node_with_two_ranks_in_its_trainer_pod(
        job, real_node, real_api):
    core = job.core
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    pool = job.namespace  # unique per test
    core.create_namespaced_config_map(job.namespace, {"metadata": {"name": "extra-files"},
                                                      "data": {"note.txt": "mounted from a template volume"}})
    manifest = _example(**{"spec.trainer.processesPerNode": 2})
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
    job.apply(manifest)
    redis_pod = _pod_name(job, "redis")

    def unschedulable():
        try:
            p = core.read_namespaced_pod(redis_pod, job.namespace)
        except client.ApiException:
            return None
        cond = next((c for c in p.status.conditions or [] if c.type == "PodScheduled"), None)
        return cond if cond is not None and cond.status == "False" else None

    # No node has the label yet: kube-scheduler leaves the first pod Unschedulable.
    cond = wait_for(unschedulable, 60, lambda: f"{redis_pod} Unschedulable\n{job.diagnostics()}", 0.2)
    # kube-scheduler 1.20 words a nodeSelector miss as the node affinity's.
    assert cond.reason == "Unschedulable" and "didn't match Pod's node affinity" in cond.message, cond
    core.patch_node(real_node.name, {"metadata": {"labels": {POOL_LABEL: pool}}})
    trainer = LogFollower(core, job.namespace, job.pod("trainer"), "trainer")
    trainer.start()
    try:
        follower = job.follow()
        password = secret_password(core.read_namespaced_secret(names.secret_name(job.name), job.namespace))
        assert password
        policy = client.NetworkingV1Api(real_api).read_namespaced_network_policy(
            names.network_policy_name(job.name), job.namespace)
        assert policy.spec.pod_selector.match_labels == names.role_selector(job.name, "redis")
        # The trainer's processes frozen (all of them: the launcher and its ranks) while each container is
        # looked at from inside: the job cannot end meanwhile (its 8 steps once ended before the actor's turn).
        # Every role runs first: the actors are created once the trainer and inference are ready.
        for role in ROLES:
            job.container(role)
        frozen = job.container("trainer")
        real_node.ctr("tasks", "pause", frozen)  # the cgroup freezer: the launcher and its ranks
        try:
            logs_seen = _look_inside(job, real_node, real_api, manifest, pool)
        finally:
            real_node.ctr("tasks", "resume", frozen)
        tj = job.wait_phase(("Succeeded", "Failed"), 600)
    finally:
        core.patch_node(real_node.name, {"metadata": {"labels": {POOL_LABEL: None}}})
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS and stage_names(st) == FULL_ORDER
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, STEPS + 1)), follower.describe()
    assert follower.metrics[-1]["documents_seen"] == STEPS * tj["spec"]["algorithm"]["samplesPerStep"]
    # processesPerNode 2: ONE trainer pod (one container, the launcher) whose launcher ran ranks 0 and 1.
    trainer.join(timeout=60)
    pods.stop()
    assert [p for p in pods.containers if "-trainer-" in p] == [job.pod("trainer")], pods.containers
    assert len(pods.containers[job.pod("trainer")]) == 1, pods.containers
    log = trainer.text
    assert "node 0: started ranks [0, 1]" in log, log[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] " in log and f"rank {rank}/2 joined the data-parallel group" in log, log[-3000:]
        assert f"rank {rank} exited 0" in log, log[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in log, log[-3000:]

    # No Secret value in status, Events, the operator's log or any pod's log (read while the pods ran).
    events = core.list_namespaced_event(job.namespace)
    assert events.items, "the operator posts Events"
    op = operator_pod(core)
    haystacks = {"status": json.dumps(st), "events": json.dumps(real_api.sanitize_for_serialization(events)),
                 "operator log": core.read_namespaced_pod_log(op.metadata.name, op.metadata.namespace), **logs_seen}
    for where, text in haystacks.items():
        assert password not in text, f"the Redis password shows in {where}"
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")


def test_two_trainer_nodes_train_data_parallel_and_succeed(job, real_api):
    """trainer.nodes: 2: two trainer pods find each other by the headless Service name the operator gives as
    MASTER_ADDR (the cluster DNS), train as ranks 0 and 1, and go together at the trainer stage. Their requests are
    lowered so both fit the one 2-CPU node beside inference (on CPU the trainers' spread is only a preference)."""
    steps = 10
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    job.apply(_example(**{"spec.trainer.nodes": 2, "spec.algorithm.maxSteps": steps,
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
