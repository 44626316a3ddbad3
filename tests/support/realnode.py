"""The real node's shared parts for the e2e tests that run on it (kubelet + containerd, the operator installed by
its chart): one cluster and one operator install per session, which every real-node module shares through the
fixtures `real_node`, `real_api` and `chart_operator` (tests/e2e/real_node/conftest.py). Starting the cluster costs ~90
s and the image imports more on a cold cache, so no module starts its own.

Also what those tests read of the node as the kubelet and containerd see it: containerd's exit events, a watch of a
namespace's pods, a container's id (for `ctr task kill`), every run of a container with its log, a PVC bound to a
hostPath PersistentVolume, and a diagnostic dump of every pod for failure messages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import helm_python as helm
from cluster.control_plane import ControlPlane
from cluster.node import POD_LOGS, ROUTE_LOCALNET, Node, running, stored_image_id
from support.clusterjob import EventFollower, read_job, secret_password
from support.helm_chart import CHART
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream
from rlkube.contract import protocol, runtime
from rlkube.controller.manifests import names
from support.waiting import wait_for
from support import ROOT

OPERATOR_IMAGE = "localhost/rlkube/operator:0.1.0"
CORE_IMAGE = "localhost/rlkube/core:0.1.0"
REDIS_IMAGE = "localhost/rlkube/redis:0.1.0"
# A job's images as `make images` built them here (spec overrides in dotted form, tests/support/specs.py).
LOCAL_IMAGES = {"spec.image": CORE_IMAGE, "spec.redis.image": REDIS_IMAGE}
VLLM_CPU_IMAGE = "localhost/rlkube/vllm:0.1.0-cpu"
BUILDS = {OPERATOR_IMAGE: "operator", CORE_IMAGE: "core", REDIS_IMAGE: "redis", VLLM_CPU_IMAGE: "vllm-cpu"}
"""Each image's name for images/build.py (`make images IMAGES=...`)."""
RELEASE, OPERATOR_NS = "rlkube", "rlkube-system"


def _host_ip() -> str:
    """The machine's own address (the default route's source): the API server's advertised address."""
    out = subprocess.run(["ip", "-4", "-json", "route", "get", "192.0.2.123"], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)[0]["prefsrc"]


def _proxy_chains() -> list[str]:
    """kube-proxy's own iptables chains (the kubelet makes KUBE-FIREWALL, KUBE-MARK-* and KUBE-KUBELET-CANARY)."""
    out = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    chains = {line.split()[0][1:] for line in out.splitlines() if line.startswith(":KUBE-")}
    return sorted(c for c in chains if c.startswith(("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-SVC-", "KUBE-SEP-",
                                                     "KUBE-FORWARD", "KUBE-PROXY-CANARY")))


@contextlib.contextmanager
def real_cluster(workdir: Path, images: tuple[str, ...] = (OPERATOR_IMAGE, CORE_IMAGE, REDIS_IMAGE)) -> Iterator[Node]:
    """The control plane and a node with cluster services (kube-proxy, DNS) and `images` imported; at the end
    nothing of kube-proxy is left (its chains, route_localnet)."""
    # The images, as `make images` builds them (a no-op when their content is unchanged): never a skip.
    built = sorted({BUILDS[ref] for ref in images})
    subprocess.run([sys.executable, str(ROOT / "images" / "build.py"), *built], check=True)
    # Pinned at once: another checkout on this machine may build the same tags from its own sources.
    ids = {ref: stored_image_id(ref) for ref in images}
    chains_before = _proxy_chains()
    route_localnet = ROUTE_LOCALNET.read_text()
    cp = ControlPlane(workdir / "cp",
                      controllers="garbagecollector,namespace,serviceaccount-token,serviceaccount,nodelifecycle,"
                                  "endpoint,endpointslice,deployment,replicaset,persistentvolume-binder",
                      extra_apiserver_args=["--kubelet-preferred-address-types=InternalIP"],
                      advertise_address=_host_ip())
    (workdir / "node").mkdir(parents=True, exist_ok=True)
    with running(cp, workdir / "node", cluster_services=True, images=images, image_ids=ids) as n:
        yield n
    assert set(_proxy_chains()) <= set(chains_before), "kube-proxy's iptables chains left behind"
    # On now though off before (another node's kube-proxy may have turned it on before this one started).
    assert not (ROUTE_LOCALNET.read_text().strip() == "1" and route_localnet.strip() == "0"), \
        "kube-proxy's route_localnet left on"


def operator_pod(core):
    """The operator's one Running and Ready pod (None while there is not exactly one)."""
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


def install_operator(node: Node, api_client):
    """charts/rlkube installed with the Helm SDK, as `helm install` does; returns its operator pod once Running,
    Ready and holding the leader-election Lease."""
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


def logs(core, namespace: str, pod: str, container: str | None = None, tail: int | None = 30) -> str:
    try:
        return core.read_namespaced_pod_log(pod, namespace, container=container, tail_lines=tail)
    except ApiException as exc:
        return f"(no log: {exc.status})"


def diagnostics(core, node: Node) -> str:
    """Every pod outside kube-system with its containers' states and the end of its log, and the kubelet's log."""
    lines = []
    for p in core.list_pod_for_all_namespaces().items:
        ns = p.metadata.namespace
        if ns == "kube-system":
            continue
        states = [(cs.name, cs.restart_count, cs.state.to_dict()) for cs in p.status.container_statuses or []]
        lines.append(f"pod {ns}/{p.metadata.name} {p.status.phase} {states}")
        lines.append(logs(core, ns, p.metadata.name)[-1500:])
    # Every route and bridge of the machine: a second route to this node's subnet would take its pods' traffic.
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    bridges = subprocess.run(["ip", "-br", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    lines.append(f"node bridge {node.bridge} on {node.subnet}; routes:\n{routes}bridges:\n{bridges}")
    lines.append("kubelet: " + (node.workdir / "kubelet.log").read_text(errors="replace")[-1500:])
    return "\n".join(lines)


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


def container_id(core, namespace: str, pod: str, container: str | None = None) -> str | None:
    """The running container's id in containerd (None while it does not run)."""
    try:
        p = core.read_namespaced_pod(pod, namespace)
    except ApiException:
        return None
    statuses = [cs for cs in p.status.container_statuses or [] if container in (None, cs.name)]
    cs = statuses[0] if len(statuses) == 1 else None
    return cs.container_id.split("://", 1)[1] if cs is not None and cs.state.running and cs.container_id else None


def hostpath_claim(core, node: Node, namespace: str, claim: str) -> Path:
    """A PVC bound (by the controller manager's binder) to a hostPath PersistentVolume on this node, writable by
    the pods' uid 10001 (hostPath is not chowned to the fsGroup)."""
    path = node.workdir / "pv" / namespace / claim
    path.mkdir(parents=True)
    subprocess.run(["chown", "10001:10001", str(path)], check=True)
    core.create_persistent_volume({
        "metadata": {"name": f"{namespace}-{claim}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "local",
                 "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path), "type": "Directory"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    })
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local", "volumeName": f"{namespace}-{claim}",
                 "resources": {"requests": {"storage": "1Gi"}}},
    })
    wait_for(lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound", 60,
             f"PVC {claim} Bound")
    return path


class ContainerExits(threading.Thread):
    """containerd's task exit events (`ctr events`): the time containerd gives each exit, and its status (137 for
    SIGKILL; the kubelet's own report of it can be lost when the pod is deleted at once)."""

    def __init__(self, node: Node):
        super().__init__(daemon=True, name="container-exits")
        self.proc = subprocess.Popen(["ctr", "--address", str(node.socket), "events"], stdout=subprocess.PIPE,
                                     text=True)
        self.exits: dict[str, datetime] = {}
        self.status: dict[str, int] = {}

    def run(self) -> None:
        for line in self.proc.stdout:
            if " /tasks/exit " in line:
                ev = json.loads(line.split(" /tasks/exit ", 1)[1])
                # exited_at has nanoseconds; fromisoformat takes microseconds.
                stamp = ev["exited_at"]
                head, _, frac = stamp.rstrip("Z").partition(".")
                self.exits[ev["container_id"]] = datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}")
                self.status[ev["container_id"]] = int(ev.get("exit_status", 0))  # a zero field is left out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.join(timeout=10)


class PodWatch(threading.Thread):
    """Every version of the namespace's pods: container ids per pod (init containers included), the
    resourceVersion of each pod's first version with a deletionTimestamp (the API server's order of the deletions),
    when this watch saw it (late under load) and a time at or before the request (from the deletionTimestamp),
    each pod's last terminated container state (exit code, reason) as the kubelet reported it, the uids of the pod
    objects each name had in the order they were seen (a recreated pod gets a new one) with the ids of each one's
    containers by container name, and the most restarts in place the kubelet counted."""

    def __init__(self, api_client, namespace: str):
        super().__init__(daemon=True, name="pod-watch")
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.containers: dict[str, set[str]] = {}
        self.deleted_at_rv: dict[str, int] = {}
        self.deletion_seen: dict[str, datetime] = {}
        self.deletion_requested: dict[str, datetime] = {}
        self.terminated: dict[str, tuple[int, str]] = {}
        self.uids: dict[str, dict[str, dict[str, set[str]]]] = {}  # name -> uid -> container name -> ids
        self.restarts: dict[str, int] = {}
        self._watch = watch.Watch()

    def run(self) -> None:
        while not self._watch._stop:
            try:
                for ev in self._watch.stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=30):
                    pod = ev["object"]
                    name = pod.metadata.name
                    by_container = self.uids.setdefault(name, {}).setdefault(pod.metadata.uid, {})
                    restarts = [cs.restart_count for cs in pod.status.container_statuses or []]
                    self.restarts[name] = max([self.restarts.get(name, 0), *restarts])
                    # Init containers too: a pod deleted while its model fetch still runs stops that container.
                    for cs in (pod.status.init_container_statuses or []) + (pod.status.container_statuses or []):
                        if cs.container_id:
                            cid = cs.container_id.split("://", 1)[1]
                            self.containers.setdefault(name, set()).add(cid)
                            by_container.setdefault(cs.name, set()).add(cid)
                        if cs.state.terminated:
                            self.terminated[name] = (cs.state.terminated.exit_code, cs.state.terminated.reason)
                    if pod.metadata.deletion_timestamp and name not in self.deleted_at_rv:
                        self.deleted_at_rv[name] = int(pod.metadata.resource_version)
                        self.deletion_seen[name] = datetime.now(timezone.utc).replace(tzinfo=None)
                        # The API server's deletionTimestamp is the request's time plus the grace period, in whole
                        # seconds (truncated): this is at or before the request, whatever this watch's lag.
                        grace = timedelta(seconds=pod.metadata.deletion_grace_period_seconds or 0)
                        stamp = pod.metadata.deletion_timestamp.astimezone(timezone.utc).replace(tzinfo=None)
                        self.deletion_requested[name] = stamp - grace
            except Exception:  # noqa: BLE001 - a dropped watch: list again
                time.sleep(0.5)

    def stop(self) -> None:
        self._watch.stop()


class RealJob:
    """One TrainingJob in a namespace of the real node: apply, read, wait, follow its trainer's events from its
    Redis pod (by pod IP: this process is on the node), and what is left of it."""

    def __init__(self, api_client, node: Node, namespace: str):
        self.api_client, self.node, self.namespace = api_client, node, namespace
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.name = ""
        self.follower: EventFollower | None = None

    def apply(self, manifest: dict) -> RealJob:
        self.name = manifest["metadata"]["name"]
        self.custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", self.namespace, "trainingjobs", manifest)
        return self

    def get(self) -> dict | None:
        return read_job(self.custom, self.namespace, self.name)

    def status(self) -> dict:
        return (self.get() or {}).get("status") or {}

    def diagnostics(self) -> str:
        return f"status {json.dumps(self.status())[:3000]}\n{diagnostics(self.core, self.node)}"

    def wait_phase(self, phases: tuple[str, ...] = ("Succeeded", "Failed"), timeout: float = 300) -> dict:
        return wait_for(lambda: (tj := self.get()) and (tj.get("status") or {}).get("phase") in phases and tj,
                        timeout, lambda: f"{self.name} in {phases}\n{self.diagnostics()}", 0.5)

    def pod(self, role: str, index: int = 0) -> str:
        return names.pod_name(self.name, role, index)

    def container(self, role: str, index: int = 0) -> str:
        """The id in containerd of the role's running container, once it runs."""
        pod = self.pod(role, index)
        return wait_for(lambda: container_id(self.core, self.namespace, pod, role), 180,
                        lambda: f"{pod} running\n{self.diagnostics()}", 0.2)

    def follow(self) -> EventFollower:
        def locate():
            p = self.core.read_namespaced_pod(self.pod("redis"), self.namespace)
            if not p.status.pod_ip:
                raise ConnectionError(f"{p.metadata.name} has no IP yet")
            secret = self.core.read_namespaced_secret(names.secret_name(self.name), self.namespace)
            return f"redis://{p.status.pod_ip}:{runtime.REDIS_PORT}/0", secret_password(secret)

        self.follower = EventFollower(locate, protocol.StreamKeys.for_job(self.namespace, self.name, "torch").events)
        self.follower.start()
        return self.follower

    def wait_step(self, step: int, timeout: float = 300) -> None:
        wait_for(lambda: self.follower.step >= step, timeout,
                 lambda: f"step {step}: {self.follower.describe()}\n{self.diagnostics()}", 0.1)

    def children_left(self) -> list[str]:
        sel = f"{names.LABEL_JOB}={self.name}"
        left = [f"pod/{p.metadata.name}"
                for p in self.core.list_namespaced_pod(self.namespace, label_selector=sel).items]
        left += [f"service/{s.metadata.name}"
                 for s in self.core.list_namespaced_service(self.namespace, label_selector=sel).items]
        left += [f"secret/{s.metadata.name}"
                 for s in self.core.list_namespaced_secret(self.namespace, label_selector=sel).items]
        return left

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()


def exec_in(core, namespace: str, pod: str, container: str, script: str) -> str:
    """What `sh -c script` prints inside the running container (exec through the API server and the kubelet)."""
    return stream(core.connect_get_namespaced_pod_exec, pod, namespace, container=container,
                  command=["sh", "-c", script], stderr=True, stdin=False, stdout=True, tty=False)


INSIDE = ("echo uid=$(id -u) gid=$(id -g); awk '/^Uid/ {print \"pid1-uid=\" $2}' /proc/1/status; "
          "awk '$2 == \"/\" {split($4, o, \",\"); print \"root=\" o[1]}' /proc/mounts; "
          "if touch /probe 2>/dev/null; then echo write=ok; else echo write=refused; fi")


def inside(core, namespace: str, pod: str, container: str) -> dict[str, str]:
    """What a shell inside the running container says of itself (INSIDE's keys: uid, gid, pid1-uid, root, write)."""
    out = exec_in(core, namespace, pod, container, INSIDE)
    return dict(line.split("=", 1) for line in out.split() if "=" in line)


@dataclasses.dataclass
class ContainerRun:
    """One run of a container: the pod object it ran in, the kubelet's restart count for it, its log so far."""

    pod_uid: str
    restart: int
    log: str = ""
    offset: int = 0
    partial: str = ""


def cri_lines(text: str) -> list[tuple[str, bool]]:
    """(message, whole line) of each line of a CRI log file ("<time> <stream> <P|F> <message>"; P: a part of a
    longer line, continued in the next record)."""
    out = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) == 4:
            out.append((parts[3], parts[2] == "F"))
    return out


class ContainerRuns(threading.Thread):
    """Every run of one container under one pod name, read from the kubelet's own log files on this machine (this
    process runs on the node) every 0.1 s and kept after the kubelet removes them: the runs of a container
    restarted in place and those of a pod recreated under the same name, in the order they were first seen. A run
    of a few seconds whose pod is deleted at once is still read (the API's log endpoint, which follows one pod's
    current container, missed those); what it wrote in its last 0.1 s before its file went away may be lost."""

    def __init__(self, namespace: str, pod: str, container: str):
        super().__init__(daemon=True, name=f"runs-{pod}")
        self.pattern = f"{namespace}_{pod}_*/{container}/*.log"
        self.runs: list[ContainerRun] = []
        self._by_file: dict[Path, ContainerRun] = {}
        self._halt = threading.Event()

    def _read(self) -> None:
        for path in sorted(POD_LOGS.glob(self.pattern)):
            run = self._by_file.get(path)
            if run is None:
                uid = path.parent.parent.name.rsplit("_", 1)[1]
                run = self._by_file[path] = ContainerRun(uid, int(path.stem))
                self.runs.append(run)
            try:
                with path.open("rb") as f:
                    f.seek(run.offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # whole records only; the rest is read when it is complete
            run.offset += end
            for message, whole in cri_lines(data[:end].decode(errors="replace")):
                run.partial += message
                if whole:
                    run.log += run.partial + "\n"
                    run.partial = ""

    def run(self) -> None:
        while not self._halt.is_set():
            self._read()
            self._halt.wait(0.1)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=15)
        self._read()

    @property
    def text(self) -> str:
        """Every run's log, in order."""
        return "".join(r.log for r in self.runs)

    def describe(self) -> str:
        """For assertion messages: each run's pod uid, restart count and the end of its log."""
        return "\n".join(f"run {i} (pod {r.pod_uid}, restart {r.restart}):\n{r.log[-2000:]}"
                          for i, r in enumerate(self.runs))
