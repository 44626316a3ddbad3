"""examples/vllm-cpu.yaml on the real node, its inference pod from the vLLM CPU image: a tier of its own.

`make test-vllm-image` (RLKUBE_VLLM_IMAGE=1) runs it; `make test` does not (the image is ~4.4 GB and its build,
import and job take many minutes on 2 cores), and without the variable every test here is skipped saying so. The
node, the chart and the looks inside containers are those of the real-node tests (tests/support/realnode.py), with the
vLLM image imported too (a node of its own: the session's shared node has only operator, core and redis). What this shows, as a user's cluster would run it:
- the vLLM image's program (`python -m rlkube.core.inference`, vLLM in-process) starts on a read-only root as
  uid 10001, with every cache it writes on the pod's writable volumes (which caches: printed);
- its /health, reached on the pod's IP, names the vLLM engine and a weights version > 0 mid-run: the trainer's
  weights were put in effect in flight, and its log says so for each version;
- the job Succeeds at its last step.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from support.realnode import (CORE_IMAGE, OPERATOR_IMAGE, OPERATOR_NS, REDIS_IMAGE, VLLM_CPU_IMAGE, RealJob,
                      create_namespace, diagnostics, exec_in, inside, install_operator, logs, real_cluster,
                      webhook_serving)
from rlkube.contract import runtime
from rlkube.controller.manifests import builders, names
from support.specs import with_overrides
from support.waiting import wait_for
from support import ROOT

pytestmark = [
    pytest.mark.vllm_image,
    pytest.mark.skipif(os.environ.get("RLKUBE_VLLM_IMAGE") != "1",
                       reason="the vLLM image tier is opt-in: `make test-vllm-image` (RLKUBE_VLLM_IMAGE=1) builds "
                              "the vllm-cpu image and runs examples/vllm-cpu.yaml on the real node"),
]

NS = "team-v"
# The example asks 1 CPU for the trainer and 2 for vLLM; this node has 2 in all (the scheduler would leave the
# inference pod Pending), so vLLM asks for half a CPU here, as tiny-cpu's native engine does. Its memory stays.
ON_TWO_CORES = {"spec.inference.resources.requests.cpu": "500m"}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with real_cluster(tmp_path_factory.mktemp("vllm-image-node"),
                      (OPERATOR_IMAGE, CORE_IMAGE, REDIS_IMAGE, VLLM_CPU_IMAGE)) as n:
        yield n


@pytest.fixture(scope="module")
def api(node):
    api = config.new_client_from_config(config_file=str(node.cp.kubeconfig))
    yield api
    api.close()


def served_versions(log: str) -> list[int]:
    return [int(v) for v in re.findall(r"weights version (\d+) in effect", log)]


def health(ip: str) -> dict | None:
    """The inference server's /health on the pod's IP (the body also comes with 503, while it warms up)."""
    try:
        with urllib.request.urlopen(f"http://{ip}:{runtime.INFERENCE_PORT}/health", timeout=5) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        return json.load(exc)
    except OSError:
        return None


# Setup included: a first import of the ~4.4 GB image into containerd takes minutes on 2 cores.
@pytest.mark.timeout(2400)
def test_vllm_cpu_example_served_from_the_vllm_image_on_the_real_node(node, api):
    core = client.CoreV1Api(api)
    print(f"\nimages into containerd (s): { {ref: round(s, 1) for ref, s in node.import_seconds.items()} }")
    operator = install_operator(node, api)
    create_namespace(core, NS)
    doc = yaml.safe_load((ROOT / "examples" / "vllm-cpu.yaml").read_text())
    assert doc["spec"]["inference"]["engine"] == "vllm"
    doc = with_overrides(doc, {"spec.image": CORE_IMAGE, "spec.inference.image": VLLM_CPU_IMAGE,
                               "spec.redis.image": REDIS_IMAGE, **ON_TWO_CORES})
    name, steps = doc["metadata"]["name"], doc["spec"]["algorithm"]["maxSteps"]
    webhook_serving(api, NS, doc, node)
    t0 = time.monotonic()
    job = RealJob(api, node, NS).apply(doc)

    def running(pod_name: str):
        try:
            p = core.read_namespaced_pod(pod_name, NS)
        except ApiException:
            return None
        return p if p.status.phase == "Running" and p.status.pod_ip else None

    pod = names.pod_name(name, "inference", 0)
    p = wait_for(lambda: running(pod), 600, lambda: f"{pod} running\n{diagnostics(core, node)}", 0.5)
    (container,) = p.spec.containers
    assert container.image == VLLM_CPU_IMAGE, container.image
    said = inside(core, NS, pod, "inference")
    uid = str(builders.RUN_AS)
    assert said == {"uid": uid, "gid": uid, "pid1-uid": uid, "root": "ro", "write": "refused"}, said

    # Mid-run: the server answers from the vLLM engine with a version the trainer sent while it kept serving.
    served = wait_for(lambda: (h := health(p.status.pod_ip)) and h.get("model_version", 0) > 0 and h, 900,
                      lambda: f"vLLM serving a weights version > 0: {health(p.status.pod_ip)}\n"
                              f"{diagnostics(core, node)}", 1.0)
    assert served["engine"] == "vllm" and served["status"] == "ok", served
    log = logs(core, NS, pod, tail=2000)
    assert "vLLM engine up" in log, log[-3000:]
    # What vLLM and torch wrote while starting and serving: all on the pod's volumes (the root refuses writes).
    written = exec_in(core, NS, pod, "inference", "find /tmp -mindepth 1 -maxdepth 3 -type d | sort | head -40").split()
    print(f"\ninference pod {pod}: {said}; /health {served}\ndirectories it made on its /tmp volume: {written}")

    st = job.wait_phase(timeout=900)["status"]
    wall = time.monotonic() - t0
    assert st["phase"] == "Succeeded", f"{st}\n{diagnostics(core, node)}"
    assert st["completion"]["finalStep"] == steps and st["completion"]["trainerExitCode"] == 0, st
    assert st["components"]["inference"]["restarts"] == 0, st["components"]
    # The inference log up to now (the teardown may have removed the pod already): every version in effect.
    log = logs(core, NS, pod, tail=5000) if running(pod) else log
    versions = served_versions(log)
    print(f"vllm-cpu on the real node: {wall:.1f}s to Succeeded; versions in effect in vLLM: {versions}")
    assert versions and max(versions) > 0 and versions == sorted(versions), versions
    errors = [line for line in core.read_namespaced_pod_log(operator.metadata.name, OPERATOR_NS).splitlines()
              if "Traceback" in line or "ERROR" in line]
    print(f"operator log: {len(errors)} error lines" + "".join(f"\n  {e[:300]}" for e in errors[:10]))
    wait_for(lambda: not core.list_namespaced_pod(NS).items, 120, "the job's pods to be gone")
