"""Code the model writes runs in the job's sandbox pods on the real node (kubelet + containerd, a RuntimeClass of the
node's `runc` handler by default, or of its `runsc` handler, gVisor; RUNTIME below), and nothing it tries gets out:

A job with spec.sandbox.mode `pods` whose environment (tests/e2e/real_node/sandbox_probe_env.py, mounted into the actor
from a claim) sends hostile snippets to the sandbox pods: a TCP connection to a listener this test holds on the node,
reads of the actor's files, the job config, a ServiceAccount token and every process' environment (the Redis
password), a fork loop, and a 1 GiB write. Under runsc the sandbox servers run with the audit hook turned off
(RLKUBE_SANDBOX_LAYERS=netns, set through spec.sandbox.template), so what holds is the pod (gVisor, its own uid,
no token, no secrets) and each snippet's own network namespace, which holds although this node's bridge CNI
enforces no NetworkPolicy; under runc (spec.sandbox.requireNetworkNamespace false) the audit hook refuses the
connection and the fork, and the pod keeps the files, the token and the password out of reach. The actor connects to the
listener once itself (it is reachable from a pod); the listener sees that connection and nothing from a snippet. The job
goes on and Succeeds, and the sandbox pods' specs as the API server stored them carry the runtimeClassName, no token,
the sandbox's uid and no capabilities.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest
from support import specs
from rlkube.lifecycle.roles import TEARDOWN_ORDER
import yaml
from support import ROOT
from support.clusterjob import secret_password
from kubernetes import client
from support.pod_security import SANDBOX_UID, assert_hardened_pod, assert_sandbox_pod
from support.realnode import LOCAL_IMAGES, ContainerRuns, hostpath_claim
from rlkube.controller.manifests import names
from support.waiting import wait_for

RUNTIME = os.environ.get("RLKUBE_E2E_SANDBOX_RUNTIME", "runc")
"""The node's runtime handler for the sandbox pods (a RuntimeClass of that handler either way): `runc` by default, where
the default seccomp profile refuses the snippets' network namespace, so the audit hook holds the network; `runsc`
(gVisor, RLKUBE_E2E_SANDBOX_RUNTIME=runsc: Debian's runsc driven by containerd's runc shim through
tests/cluster/node.py's RUNSC_WRAPPER) runs the sandbox pods (tests/integration/node/test_real_kubelet_gvisor.py), with
the audit hook off: the network namespace refuses the socket, RLIMIT_NPROC the fork loop (the child drops the
capabilities its user namespace grants, which that gVisor would otherwise exempt from the limit: docs/guide/sandbox.md),
RLIMIT_FSIZE the write. runc stays the default: gVisor's ptrace platform on a loaded 2-core machine is slow enough
that a job sized for it takes minutes longer."""
RUNTIME_CLASS = {"runsc": "gvisor", "runc": "runc"}[RUNTIME]
SNIPPET_TIMEOUT = 5
pytestmark = pytest.mark.skipif(RUNTIME == "runsc" and shutil.which("runsc") is None,
                                reason="runsc (Debian's gVisor) is not installed")


class Listener(threading.Thread):
    """A TCP listener on every address of the node; records what each connection sent."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    self.received.append(conn.recv(100))
                except OSError:
                    self.received.append(b"")

    def stop(self) -> None:
        self._halt.set()
        self.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    lst.start()
    yield lst
    lst.stop()


def _runtime_class(api) -> None:
    nodes = client.NodeV1Api(api)
    if not any(rc.metadata.name == RUNTIME_CLASS for rc in nodes.list_runtime_class().items):
        nodes.create_runtime_class({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                                    "metadata": {"name": RUNTIME_CLASS}, "handler": RUNTIME})


def _probes(runs: ContainerRuns) -> dict[str, dict]:
    out = {}
    for line in runs.text.splitlines():
        if "SANDBOX-PROBE " in line:
            doc = json.loads(line.split("SANDBOX-PROBE ", 1)[1])
            out.setdefault(doc["probe"], doc)
    return out


def test_hostile_snippets_in_gvisor_sandbox_pods_are_refused_or_bounded_and_the_job_succeeds(
        real_job, real_node, real_api, listener):
    job = real_job
    _runtime_class(real_api)
    code = hostpath_claim(job.core, real_node, job.namespace, "code")
    shutil.copy(Path(__file__).with_name("sandbox_probe_env.py"), code / "sandbox_probe_env.py")
    (code / "sandbox_probe_env.py").chmod(0o644)

    doc = yaml.safe_load((ROOT / "examples" / "calculator-cpu.yaml").read_text())
    doc["metadata"]["name"] = "sandboxed"
    manifest = specs.with_overrides(doc, {
        **LOCAL_IMAGES,
        "spec.inference.resources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
        # The probe episode sends its snippets and then times 24 tool calls while the other episodes train: under
        # gVisor, or under runc on a loaded machine (a 4-step job once ended first in CI), that takes seconds to tens
        # of seconds, so the job runs long enough to see them all (40 steps: ~15 s more than 4 under runsc).
        "spec.algorithm.maxSteps": 40, "spec.algorithm.samplesPerStep": 16,
        "spec.task.environment": {
            "entryPoint": "sandbox_probe_env:factory", "maxTurns": 3, "maxEpisodeTokens": 24,
            "toolTimeoutSeconds": 600, "episodeTimeoutSeconds": 900,
            "params": {"host": real_node.gateway, "port": listener.port},
            "sandbox": {"timeoutSeconds": SNIPPET_TIMEOUT, "cpuSeconds": 5, "memoryMib": 512},
        },
        "spec.sandbox": {
            "mode": "pods", "replicas": 2, "runtimeClassName": RUNTIME_CLASS,
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                          "limits": {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}},
            **({"template": {"spec": {"containers": [{"name": "sandbox", "env": [
                {"name": "RLKUBE_SANDBOX_LAYERS", "value": "netns"}]}]}}} if RUNTIME == "runsc" else
               {"requireNetworkNamespace": False}),
        },
        "spec.actor.template": {"spec": {
            "volumes": [{"name": "code", "persistentVolumeClaim": {"claimName": "code", "readOnly": True}}],
            "containers": [{"name": "actor", "env": [{"name": "PYTHONPATH", "value": "/code"}],
                            "volumeMounts": [{"name": "code", "mountPath": "/code", "readOnly": True}]}]}},
        "spec.teardown.gracePeriodSeconds": {"actor": 10, "preprocessor": 10, "inference": 10, "trainer": 30,
                                             "redis": 10, "sandbox": 5},
    })
    actor_runs = ContainerRuns(job.namespace, names.pod_name("sandboxed", "actor", 0), "actor")
    actor_runs.start()
    job.apply(manifest)

    # The sandbox pod as the API server stored it, while it runs.
    sandbox_pod = names.pod_name("sandboxed", "sandbox", 0)
    stored = wait_for(lambda: (p := _read_pod(job.core, job.namespace, sandbox_pod)) and p.status.phase == "Running"
                      and p, 300, lambda: f"{sandbox_pod} Running\n{job.diagnostics()}", 0.5)
    # The snippets' network namespace is up in the pod (gVisor grants it to uid 10002 under seccomp RuntimeDefault),
    # or the server would have exited 78 (spec.sandbox.requireNetworkNamespace).
    assert stored.status.container_statuses[0].restart_count == 0, job.diagnostics()
    spec_doc = real_api.sanitize_for_serialization(stored)
    assert spec_doc["spec"]["runtimeClassName"] == RUNTIME_CLASS
    assert spec_doc["spec"]["automountServiceAccountToken"] is False
    assert not any(v.get("projected") for v in spec_doc["spec"].get("volumes") or []), spec_doc["spec"]["volumes"]
    assert spec_doc["spec"]["securityContext"]["runAsUser"] == SANDBOX_UID
    assert spec_doc["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert_hardened_pod(spec_doc, manifest["spec"])
    assert_sandbox_pod(spec_doc, manifest["spec"])
    password = secret_password(job.core.read_namespaced_secret(names.secret_name("sandboxed"), job.namespace))

    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    actor_runs.stop()
    assert tj["status"]["phase"] == "Succeeded", job.diagnostics()
    probes = _probes(actor_runs)
    assert set(probes) == {"socket", "read", "fork", "write", "ok"}, actor_runs.describe()[-4000:]
    summary = {k: (v["outcome"], v["layers"], round(v["seconds"], 2)) for k, v in probes.items()}
    print(f"\nsandbox pods under {RUNTIME}: {summary}; listener saw {listener.received}")
    for p in probes.values():
        assert p["server"].startswith("http://sandboxed-sandbox-"), p
        # runsc: the audit hook is off, the pod and the namespace hold alone; runc: no namespace, the hook holds.
        # (A snippet killed at its wall limit never reported its layers: the fork loop under runsc.)
        if p["outcome"] not in ("timeout", "killed"):
            assert p["layers"] == (["netns"] if RUNTIME == "runsc" else ["audit"]), p

    # The listener is reachable from a pod (the actor's own connection) and saw nothing from a snippet.
    assert b"actor-control" in listener.received, listener.received
    assert not [r for r in listener.received if r != b"actor-control"], listener.received
    sock = probes["socket"]
    assert sock["outcome"] == "refused", sock
    assert sock["refused_by"] == ("network namespace" if RUNTIME == "runsc" else "audit hook"), sock
    assert "connected" not in sock["stdout"]

    read = probes["read"]
    assert read["outcome"] == "ok", read
    seen = json.loads(read["stdout"])
    assert all(v in ("FileNotFoundError", "PermissionError") for v in seen["files"].values()), seen["files"]
    assert password not in read["stdout"] and "REDIS_PASSWORD" not in read["stdout"]
    assert not [k for k in seen["own_env"] if k.startswith(("RLKUBE_", "REDIS"))], seen["own_env"]

    fork = probes["fork"]
    # runc: the audit hook refuses the first fork. runsc (hook off): RLIMIT_NPROC refuses the fork past its count
    # (BlockingIOError, not the wall limit: the child dropped its namespace's capabilities); a sandbox pod killed
    # for memory on the way would answer `unavailable` and be replaced.
    if RUNTIME == "runsc":
        assert fork["outcome"] == "unavailable" or (
            fork["outcome"] == "error" and "BlockingIOError" in fork["stderr"]), fork
    else:
        assert fork["outcome"] == "refused" and fork["refused_by"] == "audit hook", fork
    assert fork["seconds"] < SNIPPET_TIMEOUT + 10, fork
    write = probes["write"]
    assert write["outcome"] == "output" and "wrote 1 GiB" not in write["stdout"], write
    assert probes["ok"]["outcome"] == "ok" and probes["ok"]["stdout"].splitlines()[0] == "42", probes["ok"]
    # gVisor's sentry answered the snippet, not this machine's kernel.
    host_kernel = Path("/proc/version").read_text().strip()
    assert (probes["ok"]["stdout"].splitlines()[1].strip() != host_kernel) == (RUNTIME == "runsc"), probes["ok"]
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    stages = [s["name"] for s in tj["status"]["teardown"]["stages"]]
    assert stages == list(TEARDOWN_ORDER), stages  # the sandbox pods stop in the actors' stage
    timings = [json.loads(line.split("SANDBOX-TIMING ", 1)[1]) for line in actor_runs.text.splitlines()
               if "SANDBOX-TIMING " in line]
    assert timings, f"no SANDBOX-TIMING line from the actor: {actor_runs.describe()[-4000:]}"
    timing = timings[0]
    print(f"tool call `print(sum(range(1000)))` from the actor, 10 calls each: through the sandbox pod ({RUNTIME}) "
          f"median {timing['pod']['median_ms']:.1f} ms p99 {timing['pod']['p99_ms']:.1f} ms; in the actor's process "
          f"(runc, layers {timing['in_process_layers']}) median {timing['in_process']['median_ms']:.1f} ms "
          f"p99 {timing['in_process']['p99_ms']:.1f} ms")


def _read_pod(core, namespace: str, name: str):
    try:
        return core.read_namespaced_pod(name, namespace)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
