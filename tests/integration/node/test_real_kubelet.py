"""The operator's pods under a real kubelet on containerd and runc (tests/cluster/node.py), not the node agent.

The trainer pod exactly as the operator builds it for examples/tiny-cpu.yaml (builders.core_pod: its security
context, volumes, termination-message policy, resources), with only its image and command replaced by a busybox
script built into an image here (no registry serves ours on this machine), runs on a control plane with
kube-scheduler and a kubelet of its own. What the real parts enforce, shown from inside the container:
- it runs as uid 10001 (group 10001, fsGroup 10001 among its groups) with no capabilities;
- a write to its root filesystem fails (read-only root), while the /tmp emptyDir is writable and /dev/shm is a
  memory-backed volume; the job's ConfigMap is mounted read-only at /etc/rlkube;
- what it writes to /dev/termination-log reaches the pod's status with its exit code (runtime.EXIT_CONFIG, 78),
  which is what the operator's judgement reads;
- a container killed with SIGKILL through containerd is restarted in place by the kubelet (same pod, restart
  count 1), as the operator's restart budgets expect.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from support import specs
from cluster.control_plane import ControlPlane
from cluster.node import BUSYBOX_IMAGE, Node, running
from kubernetes import client, config
from rlkube.contract import runtime
from rlkube.controller.manifests import builders, names
from rlkube.lifecycle.validation import parse_spec
from support.waiting import wait_for

NAMESPACE = "default"

PROBE = r"""
echo "ids: uid=$(busybox id -u) gid=$(busybox id -g) groups=$(busybox id -G)"
if echo x 2>/dev/null > /probe; then echo "root: writable"; else echo "root: read-only"; fi
if echo x > /tmp/probe; then echo "tmp: writable"; fi
echo "shm: $(busybox awk '$2 == "/dev/shm" {print $3}' /proc/mounts)"
echo "config: $(busybox head -c 1 /etc/rlkube/job.json)"
if echo x 2>/dev/null > /etc/rlkube/probe; then echo "config-mount: writable"; else echo "config-mount: read-only"; fi
echo "caps: $(busybox awk '/^CapEff/ {print $2}' /proc/self/status)"
echo "spec.task.dataset.promptField: the probe says why it stops" > /dev/termination-log
exit 78
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    cp = ControlPlane(tmp_path_factory.mktemp("real-node-cp"),
                      controllers="garbagecollector,namespace,serviceaccount-token,serviceaccount,nodelifecycle",
                      extra_apiserver_args=["--kubelet-preferred-address-types=InternalIP"])
    with running(cp, tmp_path_factory.mktemp("real-node")) as n:
        yield n


@pytest.fixture(scope="module")
def core(node):
    api = config.new_client_from_config(config_file=str(node.cp.kubeconfig))
    yield client.CoreV1Api(api)
    api.close()


def _job() -> builders.JobRef:
    doc = specs.document()
    raw = doc["spec"]
    return builders.JobRef(namespace=NAMESPACE, name=doc["metadata"]["name"], uid="u-1", spec=parse_spec(raw),
                           raw_spec=raw)


def _as_test_pod(pod: dict, name: str, script: str, restart: str) -> dict:
    """The operator's pod with a busybox script for its command; no owner (the job object does not exist here,
    and the garbage collector would delete an orphan) and no init container (it would run our image)."""
    pod = copy.deepcopy(pod)
    pod["metadata"]["name"] = name
    pod["metadata"].pop("ownerReferences", None)
    spec = pod["spec"]
    spec.pop("initContainers", None)
    spec["restartPolicy"] = restart
    (main,) = spec["containers"]
    main.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never", command=["/bin/sh", "-c", script])
    main.pop("ports", None)
    main.pop("readinessProbe", None)
    return pod


def _terminated(core, name: str):
    pod = core.read_namespaced_pod(name, NAMESPACE)
    statuses = pod.status.container_statuses or []
    return statuses[0].state.terminated if statuses and statuses[0].state.terminated else None


def test_the_operators_trainer_pod_runs_hardened_under_the_real_kubelet(node, core):
    job = _job()
    # What the pod reads: the job's ConfigMap and its Redis password Secret, as the operator creates them.
    for child in builders.static_children(job, password="pw"):
        child["metadata"].pop("ownerReferences", None)
        if child["kind"] == "ConfigMap":
            core.create_namespaced_config_map(NAMESPACE, child)
        elif child["kind"] == "Secret":
            core.create_namespaced_secret(NAMESPACE, child)
    built = builders.core_pod(job, "trainer", 0)
    (main,) = built["spec"]["containers"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True  # what this test shows enforced
    pod = _as_test_pod(built, "hardened", PROBE, "Never")
    core.create_namespaced_pod(NAMESPACE, pod)

    state = wait_for(lambda: _terminated(core, "hardened"), 120,
                     lambda: f"the probe pod to end; kubelet log: {_tail(node, 'kubelet')}", 0.5)
    assert state.exit_code == runtime.EXIT_CONFIG
    assert state.message.strip() == "spec.task.dataset.promptField: the probe says why it stops"
    got = core.read_namespaced_pod("hardened", NAMESPACE)
    assert got.spec.node_name == node.name and got.status.phase == "Failed"
    logs = core.read_namespaced_pod_log("hardened", NAMESPACE)  # through the API server, from the kubelet
    print(f"\nthe operator's trainer pod under the real kubelet said:\n{logs}")
    lines = dict(line.split(": ", 1) for line in logs.splitlines() if ": " in line)
    uid = builders.RUN_AS
    assert lines["ids"].startswith(f"uid={uid} gid={uid} groups=") and str(uid) in lines["ids"].split("groups=")[1]
    assert lines["root"] == "read-only", logs
    assert lines["tmp"] == "writable" and lines["shm"] == "tmpfs", logs
    assert lines["config"] == "{" and lines["config-mount"] == "read-only", logs  # the job's ConfigMap, as JSON
    assert int(lines["caps"], 16) == 0, logs  # capabilities.drop: [ALL]
    assert names.CONFIG_MOUNT == "/etc/rlkube"  # where the script looked


KILLABLE = r"""
echo "started $(busybox date +%s%N)"
while true; do busybox sleep 1; done
"""


def test_a_container_killed_through_containerd_is_restarted_in_place(node, core):
    pod = _as_test_pod(builders.core_pod(_job(), "actor", 0), "killable", KILLABLE, "OnFailure")
    pod["spec"]["terminationGracePeriodSeconds"] = 2
    created = core.create_namespaced_pod(NAMESPACE, pod)

    def running(restarts: int):
        got = core.read_namespaced_pod("killable", NAMESPACE)
        st = (got.status.container_statuses or [None])[0]
        return got if st is not None and st.state.running and st.restart_count == restarts else None

    wait_for(lambda: running(0), 120, lambda: f"the pod to run; kubelet log: {_tail(node, 'kubelet')}", 0.5)
    container_id = core.read_namespaced_pod("killable", NAMESPACE).status.container_statuses[0].container_id
    task = container_id.split("://", 1)[1]
    node.ctr("tasks", "kill", "--signal", "SIGKILL", task)
    got = wait_for(lambda: running(1), 120, lambda: f"the restart; kubelet log: {_tail(node, 'kubelet')}", 0.5)
    assert got.metadata.uid == created.metadata.uid  # the same pod, restarted in place
    last = got.status.container_statuses[0].last_state.terminated
    assert last.exit_code == 137 and last.reason == "Error"
    core.delete_namespaced_pod("killable", NAMESPACE, grace_period_seconds=2)

    def gone():
        try:
            core.read_namespaced_pod("killable", NAMESPACE)
            return False
        except client.ApiException as exc:
            return exc.status == 404

    wait_for(gone, 60, "the pod to be deleted", 0.5)
    assert task not in node.ctr("tasks", "list", "-q").stdout.split()  # the kubelet stopped the container


def _tail(node: Node, name: str) -> str:
    return (Path(node.workdir) / f"{name}.log").read_text(errors="replace")[-2000:]

