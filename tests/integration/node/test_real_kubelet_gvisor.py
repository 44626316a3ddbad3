"""The operator's sandbox pod under a real kubelet on containerd and gVisor (the test node's `runsc` handler through
a `gvisor` RuntimeClass, tests/cluster/node.py), not the node agent.

The sandbox pod exactly as the operator builds it (builders.sandbox_pod: its uid, capabilities, read-only root, no
ServiceAccount token, runtimeClassName `gvisor`), with only its image and command replaced by a busybox script
(no registry serves ours on this machine). What the real parts do, shown from inside the container and from the
API server:
- the container runs on gVisor's kernel (its /proc/version is not this machine's), as the sandbox's uid with no
  capabilities, no token and a read-only root (its termination message says so);
- its exit code reaches the pod's status (the shim sees the container end, not only its pod);
- a running one's output reaches the pod's log, and it stops when its pod is deleted.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support import specs
from cluster.control_plane import ControlPlane
from cluster.node import BUSYBOX_IMAGE, RUNSC_HANDLER, Node, running
from kubernetes import client, config
from rlkube.controller.manifests import builders
from rlkube.lifecycle.validation import parse_spec
from support.waiting import wait_for

NAMESPACE = "default"
RUNTIME_CLASS = "gvisor"
pytestmark = pytest.mark.skipif(shutil.which("runsc") is None, reason="runsc (Debian's gVisor) is not installed")

PROBE = r"""
{
echo "kernel: $(busybox cat /proc/version)"
echo "ids: uid=$(busybox id -u)"
echo "caps: $(busybox awk '/^CapEff/ {print $2}' /proc/self/status)"
if [ -e /var/run/secrets/kubernetes.io/serviceaccount/token ]; then echo "token: mounted"; else echo "token: none"; fi
if echo x 2>/dev/null > /probe; then echo "root: writable"; else echo "root: read-only"; fi
} > /dev/termination-log
exit 3
"""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    cp = ControlPlane(tmp_path_factory.mktemp("gvisor-node-cp"),
                      controllers="garbagecollector,namespace,serviceaccount-token,serviceaccount,nodelifecycle",
                      extra_apiserver_args=["--kubelet-preferred-address-types=InternalIP"])
    with running(cp, tmp_path_factory.mktemp("gvisor-node")) as n:
        yield n


@pytest.fixture(scope="module")
def api(node):
    api = config.new_client_from_config(config_file=str(node.cp.kubeconfig))
    client.NodeV1Api(api).create_runtime_class({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                                "metadata": {"name": RUNTIME_CLASS}, "handler": RUNSC_HANDLER})
    yield api
    api.close()


def _sandbox_pod(name: str, script: str, restart: str) -> dict:
    raw = specs.spec(**{"task.environment": {"name": "calculator"},
                        "sandbox": {"mode": "pods", "replicas": 1, "runtimeClassName": RUNTIME_CLASS}})
    job = builders.JobRef(namespace=NAMESPACE, name="gv", uid="u-1", spec=parse_spec(raw), raw_spec=raw)
    pod = copy.deepcopy(builders.sandbox_pod(job, 0))
    pod["metadata"]["name"] = name
    pod["metadata"].pop("ownerReferences", None)  # no job object here: the garbage collector would delete it
    pod["spec"]["restartPolicy"] = restart
    (main,) = pod["spec"]["containers"]
    main.update(image=BUSYBOX_IMAGE, imagePullPolicy="Never", command=["/bin/sh", "-c", script])
    main.pop("readinessProbe", None)
    return pod


def _tail(node: Node, name: str) -> str:
    return (Path(node.workdir) / f"{name}.log").read_text(errors="replace")[-2000:]


def _stuck(node: Node, core: client.CoreV1Api, name: str) -> str:
    """What a pod that does not go away is waiting on: its status as the API server has it, the kubelet's and
    containerd's lines that name its uid or its containers (the tail alone is the kubelet's garbage collector),
    and the runsc processes still alive."""
    try:
        got = core.read_namespaced_pod(name, NAMESPACE)
    except client.ApiException as exc:
        return f"pod read failed: {exc.status}"
    keys = [got.metadata.uid] + [st.container_id.rsplit("/", 1)[-1] for st in got.status.container_statuses or []
                                 if st.container_id]
    logs = {log: (Path(node.workdir) / f"{log}.log").read_text(errors="replace").splitlines()
            for log in ("kubelet", "containerd")}
    # The pod sandbox's id appears only in lines that name the pod once ("returns sandbox id ..."): take it too.
    keys += {i for line in logs["containerd"] if keys[0] in line for i in re.findall(r"[0-9a-f]{64}", line)}
    lines = []
    for log, text in logs.items():
        lines += [f"{log}: {line[:400]}" for line in text if any(k in line for k in keys)][-25:]
    procs = subprocess.run(["ps", "-eww", "-o", "pid,etimes,stat,args"], capture_output=True, text=True).stdout
    runsc = [line[:300] for line in procs.splitlines() if "runsc" in line]
    return (f"deletionTimestamp={got.metadata.deletion_timestamp} phase={got.status.phase} "
            f"containers={[(st.name, st.state.to_dict()) for st in got.status.container_statuses or []]}\n"
            + "\n".join(lines) + "\nrunsc processes:\n" + "\n".join(runsc))


def test_the_operators_sandbox_pod_runs_on_gvisor_and_its_exit_reaches_the_kubelet(node, api):
    core = client.CoreV1Api(api)
    pod = _sandbox_pod("gvisor-probe", PROBE, "Never")
    assert pod["spec"]["runtimeClassName"] == RUNTIME_CLASS and pod["spec"]["automountServiceAccountToken"] is False
    core.create_namespaced_pod(NAMESPACE, pod)

    def terminated():
        got = core.read_namespaced_pod("gvisor-probe", NAMESPACE)
        st = (got.status.container_statuses or [None])[0]
        return st.state.terminated if st is not None and st.state.terminated else None

    state = wait_for(terminated, 180, lambda: f"the probe pod to end; kubelet log: {_tail(node, 'kubelet')}", 0.5)
    assert state.exit_code == 3, state
    logs = state.message  # what the probe wrote to /dev/termination-log, as the kubelet read it after the exit
    print(f"\nthe operator's sandbox pod under gVisor said:\n{logs}")
    lines = dict(line.split(": ", 1) for line in logs.splitlines() if ": " in line)
    assert lines["kernel"].startswith("Linux version") and lines["kernel"] != Path("/proc/version").read_text().strip()
    assert lines["ids"] == f"uid={builders.SANDBOX_RUN_AS}", logs
    assert int(lines["caps"], 16) == 0 and lines["token"] == "none" and lines["root"] == "read-only", logs


def test_a_running_sandbox_pod_on_gvisor_stops_when_deleted(node, api):
    core = client.CoreV1Api(api)
    pod = _sandbox_pod("gvisor-server", "echo serving; while true; do busybox sleep 1; done", "Always")
    pod["spec"]["terminationGracePeriodSeconds"] = 3
    core.create_namespaced_pod(NAMESPACE, pod)

    def running_pod():
        got = core.read_namespaced_pod("gvisor-server", NAMESPACE)
        st = (got.status.container_statuses or [None])[0]
        return got if st is not None and st.state.running else None

    wait_for(running_pod, 180, lambda: f"the pod to run; kubelet log: {_tail(node, 'kubelet')}", 0.5)
    wait_for(lambda: "serving" in core.read_namespaced_pod_log("gvisor-server", NAMESPACE), 30, "its log")
    core.delete_namespaced_pod("gvisor-server", NAMESPACE, grace_period_seconds=3)

    def gone():
        try:
            core.read_namespaced_pod("gvisor-server", NAMESPACE)
            return False
        except client.ApiException as exc:
            return exc.status == 404

    # The shell ignores SIGTERM as pid 1: the kubelet kills it after the grace period, and the pod goes. Each
    # step (the kill, the holder's `runsc wait`, the sandbox's stop and delete) is a runsc call on the ptrace
    # platform, which a loaded machine slows many times over: the bound is the one the pod had to start.
    wait_for(gone, 180, lambda: f"the pod to be deleted: {_stuck(node, core, 'gvisor-server')}", 0.5)
