"""Pod templates, hardening and trainer ranks through the real operator, pods run by the test node agent.

- A job whose every role carries a template (env, a ConfigMap volume mounted read-only, a nodeSelector) waits
  Unschedulable until the node gets the label, then runs: the running processes see the variable and the
  volume's file; every pod as the API server stored it passes the security assertion; the Redis NetworkPolicy
  exists while the job runs; the Redis password is in no status, Event, operator log or pod log.
- `trainer.processesPerNode: 2` on CPU: ONE trainer pod whose launcher runs ranks 0 and 1, and the job succeeds.
"""

from __future__ import annotations

import json
from pathlib import Path

from clusterjob import FULL_ORDER, example, secret_password
from kubernetes import client
from nodeagent.harness import pod_condition, wait_for
from pod_security import assert_hardened_pod

from rlkube.controller import names

STEPS = 8
POOL_LABEL = "e2e.rlkube.io/pool"


def _proc_environ(pid: int) -> dict[str, str]:
    """The environment the container's command was exec'd with (once the node agent's podinit has exec'd it)."""
    wait_for(lambda: b"podinit.py" not in Path(f"/proc/{pid}/cmdline").read_bytes(), 30, f"pid {pid} exec'd")
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_env_volume_and_node_selector_overrides_run_on_the_labelled_node(job, core_api, api_client, operator,
                                                                         namespace, node_agent):
    pool = namespace  # unique per test: the session's node may carry labels of earlier tests
    core_api.create_namespaced_config_map(namespace, {"metadata": {"name": "extra-files"},
                                                      "data": {"note.txt": "mounted from a template volume"}})
    manifest = example(**{"spec.algorithm.maxSteps": STEPS})
    for role in ("trainer", "inference", "actor", "preprocessor", "redis"):
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
    redis_pod = names.pod_name(job.name, "redis")

    # No node has the label yet: the node agent (as kube-scheduler) leaves the first pod Unschedulable.
    unschedulable = wait_for(lambda: (p := job.pod("redis")) and pod_condition(p, "PodScheduled") == "False" and p,
                             60, f"{redis_pod} Unschedulable")
    assert POOL_LABEL in unschedulable.status.conditions[0].message
    assert not job.agent_signals() and not node_agent.pod_state(namespace, redis_pod)
    node = node_agent.node_name
    core_api.patch_node(node, {"metadata": {"labels": {POOL_LABEL: pool}}})
    try:
        follower = job.follow()
        password = secret_password(core_api.read_namespaced_secret(names.secret_name(job.name), namespace))
        assert password
        policy = client.NetworkingV1Api(api_client).read_namespaced_network_policy(
            names.network_policy_name(job.name), namespace)
        assert policy.spec.pod_selector.match_labels == names.role_selector(job.name, "redis")

        # The running processes see the template's variable and volume (read through /proc, in their namespace).
        for role in ("trainer", "actor", "inference", "preprocessor", "redis"):
            pid = job.pid(role)
            env = _proc_environ(pid)
            if role != "redis":  # redis-server rewrites its process title over its environment block
                assert env.get("GREETING") == f"hello from {role}", (role, sorted(env))
                assert env["HOME"] == "/tmp" and env["RLKUBE_INDEX"] == "0"
            assert Path(f"/proc/{pid}/root/extra/note.txt").read_text() == "mounted from a template volume"
        # What the API server stored: the merged pod, hardened, with the template's placement and labels.
        stored = {}
        for role in ("trainer", "inference", "actor", "preprocessor", "redis"):
            pod = api_client.sanitize_for_serialization(job.pod(role))
            stored[role] = pod
            assert pod["spec"]["nodeSelector"] == {POOL_LABEL: pool} and pod["spec"]["nodeName"] == node
            assert pod["metadata"]["labels"]["team"] == "rl-e2e"
            assert {"name": "GREETING", "value": f"hello from {role}"} in pod["spec"]["containers"][0]["env"]
            assert_hardened_pod(pod, manifest["spec"])

        tj = job.wait_phase(("Succeeded", "Failed"), 600)
    finally:
        core_api.patch_node(node, {"metadata": {"labels": {POOL_LABEL: None}}})
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS
    follower.stop()
    assert job.order("deletion") == FULL_ORDER, job.agent_signals()

    # No Secret value in status, Events, the operator's log or any pod's log.
    events = core_api.list_namespaced_event(namespace)
    assert events.items, "the operator posts Events"
    logs = {role: node_agent.container_log(namespace, names.pod_name(job.name, role, 0)) for role in stored}
    assert all(logs.values()), {r: len(t) for r, t in logs.items()}
    haystacks = {"status": json.dumps(st), "events": json.dumps(api_client.sanitize_for_serialization(events)),
                 "operator log": operator.log_path.read_text(errors="replace"), **logs}
    for where, text in haystacks.items():
        assert password not in text, f"the Redis password shows in {where}"
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []


def test_two_local_ranks_inside_one_trainer_pod(job):
    job.apply(example(**{"spec.algorithm.maxSteps": STEPS, "spec.trainer.processesPerNode": 2}))
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 600)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == STEPS and st["completion"]["trainerExitCode"] == 0
    follower.stop()
    assert [m["step"] for m in follower.metrics] == list(range(1, STEPS + 1)), follower.describe()
    # One trainer pod (one container process, the launcher), two ranks in it.
    trainer_pods = {name for name in job.uids_per_pod() if "-trainer-" in name}
    assert trainer_pods == {f"{job.name}-trainer-0"}
    log = job.agent.container_log(job.namespace, f"{job.name}-trainer-0")
    assert "node 0: started ranks [0, 1]" in log, log[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] " in log and f"rank {rank}/2 joined the data-parallel group" in log, log[-3000:]
        assert f"rank {rank} exited 0" in log, log[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in log, log[-3000:]
    assert follower.metrics[-1]["documents_seen"] == STEPS * tj["spec"]["algorithm"]["samplesPerStep"]
    assert job.order("deletion") == FULL_ORDER, job.agent_signals()
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
