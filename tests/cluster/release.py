"""The real node with the operator installed by its chart: what every real-node e2e test starts from.

Test infrastructure (not shipped), shared by tests/e2e/test_real_cluster.py (tiny-cpu, chaos) and
tests/e2e/test_vllm_image.py (the vLLM CPU image, its own tier) so both start the node, install the chart and look
inside containers the same way:
- `real_node(tmp_path_factory, images)`: the project's images built as `make images` builds them (a no-op when
  their content is unchanged), a control plane advertised on the machine's address and a node of it with the
  cluster's services (kube-proxy, DNS) and those images; at the end nothing of kube-proxy may be left behind
  (its iptables chains, route_localnet).
- `install_chart(node, api_client)`: charts/rlkube installed with the Helm SDK as `helm install` does; returns the
  operator pod once it is Running, Ready and holding the leader-election Lease.
- `inside(...)`: what a shell inside a running container says of itself (uid, gid, pid 1's uid, the root's
  mount flag, whether a write to / is refused); `diagnostics(...)`: every pod's state and log tail, the kubelet's.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import helm_python as helm
from cluster.control_plane import ControlPlane
from cluster.node import ROUTE_LOCALNET, Node, running
from helm_chart import CHART
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream
from waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
# images/build.py's names and the tags it gives them.
IMAGES = {
    "operator": "localhost/rlkube/operator:0.1.0",
    "core": "localhost/rlkube/core:0.1.0",
    "redis": "localhost/rlkube/redis:0.1.0",
    "vllm-cpu": "localhost/rlkube/vllm:0.1.0-cpu",
}
OPERATOR_IMAGE = IMAGES["operator"]
RELEASE, OPERATOR_NS = "rlkube", "rlkube-system"


def host_ip() -> str:
    """The machine's own address (the default route's source): the API server's advertised address."""
    out = subprocess.run(["ip", "-4", "-json", "route", "get", "192.0.2.123"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)[0]["prefsrc"]


def proxy_chains() -> list[str]:
    """kube-proxy's own iptables chains (the kubelet makes KUBE-FIREWALL, KUBE-MARK-* and KUBE-KUBELET-CANARY)."""
    out = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    chains = {line.split()[0][1:] for line in out.splitlines() if line.startswith(":KUBE-")}
    return sorted(c for c in chains if c.startswith(("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-SVC-", "KUBE-SEP-",
                                                     "KUBE-FORWARD", "KUBE-PROXY-CANARY")))


@contextlib.contextmanager
def real_node(tmp_path_factory, images: tuple[str, ...]) -> Iterator[Node]:
    """A running node with the cluster's services and `images` (images/build.py's names) in its containerd."""
    subprocess.run([sys.executable, str(ROOT / "images" / "build.py"), *images], check=True)
    chains_before = proxy_chains()
    route_localnet = ROUTE_LOCALNET.read_text()
    cp = ControlPlane(tmp_path_factory.mktemp("real-cluster-cp"),
                      controllers="garbagecollector,namespace,serviceaccount-token,serviceaccount,nodelifecycle,"
                                  "endpoint,endpointslice,deployment,replicaset,persistentvolume-binder",
                      extra_apiserver_args=["--kubelet-preferred-address-types=InternalIP"],
                      advertise_address=host_ip())
    with running(cp, tmp_path_factory.mktemp("real-cluster-node"), cluster_services=True,
                 images=tuple(IMAGES[i] for i in images)) as n:
        yield n
    assert set(proxy_chains()) <= set(chains_before), "kube-proxy's iptables chains left behind"
    assert ROUTE_LOCALNET.read_text() == route_localnet, "kube-proxy's route_localnet left on"


def operator_pod(core):
    pods = core.list_namespaced_pod(OPERATOR_NS, label_selector="app.kubernetes.io/component=operator").items
    ready = [p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
             and all(cs.ready for cs in p.status.container_statuses or [])]
    return ready[0] if len(ready) == 1 else None


def lease_holder(api_client) -> str | None:
    try:
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(RELEASE, OPERATOR_NS)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return lease.spec.holder_identity


INSIDE = ("echo uid=$(id -u) gid=$(id -g); awk '/^Uid/ {print \"pid1-uid=\" $2}' /proc/1/status; "
          "awk '$2 == \"/\" {split($4, o, \",\"); print \"root=\" o[1]}' /proc/mounts; "
          "if touch /probe 2>/dev/null; then echo write=ok; else echo write=refused; fi")


def exec_in(core, namespace: str, pod: str, container: str, command: list[str]) -> str:
    """`command`'s output in the running container (exec through the API server and the kubelet)."""
    return stream(core.connect_get_namespaced_pod_exec, pod, namespace, container=container, command=command,
                  stderr=True, stdin=False, stdout=True, tty=False)


def inside(core, namespace: str, pod: str, container: str) -> dict[str, str]:
    """What a shell inside the running container says of itself (INSIDE's keys)."""
    out = exec_in(core, namespace, pod, container, ["sh", "-c", INSIDE])
    return dict(line.split("=", 1) for line in out.split() if "=" in line)


def logs(core, namespace: str, pod: str, tail_lines: int = 30) -> str:
    try:
        return core.read_namespaced_pod_log(pod, namespace, tail_lines=tail_lines)
    except ApiException as exc:
        return f"(no log: {exc.status})"


def diagnostics(core, node: Node) -> str:
    lines = []
    for p in core.list_pod_for_all_namespaces().items:
        ns = p.metadata.namespace
        states = [(cs.name, cs.restart_count, cs.state.to_dict()) for cs in p.status.container_statuses or []]
        lines.append(f"pod {ns}/{p.metadata.name} {p.status.phase} {states}")
        lines.append(logs(core, ns, p.metadata.name)[-1500:])
    lines.append("kubelet: " + (node.workdir / "kubelet.log").read_text(errors="replace")[-1500:])
    return "\n".join(lines)


def install_chart(node: Node, api_client):
    """charts/rlkube installed with the Helm SDK, as `helm install` does; its operator pod Running and leading."""
    core = client.CoreV1Api(api_client)
    t0 = time.monotonic()
    with helm.Config(kubeconfig_path=node.cp.kubeconfig, namespace=OPERATOR_NS) as helm_config:
        values = {"image": {"repository": OPERATOR_IMAGE.rsplit(":", 1)[0], "tag": OPERATOR_IMAGE.rsplit(":", 1)[1],
                            "pullPolicy": "Never"}}
        rel = helm_config.install(CHART, RELEASE, values, namespace=OPERATOR_NS, create_namespace=True, timeout=60)
        assert rel["status"] == "deployed"
    pod = wait_for(lambda: operator_pod(core), 180,
                   lambda: f"the operator pod Running and Ready\n{diagnostics(core, node)}", 0.5)
    holder = wait_for(lambda: lease_holder(api_client), 60, "the operator to take the Lease", 0.5)
    assert holder.startswith(f"{pod.metadata.name}_"), holder
    print(f"\nchart installed, operator {pod.metadata.name} Running and leading after {time.monotonic() - t0:.1f}s")
    return pod


def webhook_serving(api_client, namespace: str, doc: dict, node: Node) -> None:
    """Waits until the chart's validating webhook answers: a dry run of `doc` passes (the Service's endpoints reach
    kube-proxy's rules a moment after the operator pod is Ready; until then the API server refuses every
    TrainingJob with "failed calling webhook")."""
    custom = client.CustomObjectsApi(api_client)

    def serving():
        try:
            return custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", namespace, "trainingjobs", doc,
                                                          dry_run="All") is not None
        except ApiException as exc:
            if exc.status == 500 and "failed calling webhook" in (exc.body or ""):
                return False
            raise

    wait_for(serving, 60, lambda: f"the webhook to answer\n{diagnostics(client.CoreV1Api(api_client), node)}", 0.2)


def create_namespace(core, name: str) -> None:
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.list_namespaced_service_account(name).items, 30, f"{name}'s default ServiceAccount")
