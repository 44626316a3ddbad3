"""Images a user can get: `make push` into a registry, and the real node pulling from it with the chart's one value.

Debian's docker-registry (the Makefile's APT_PACKAGES) runs as a process this module starts, with a config file it
writes, on the machine's own address (not loopback, which containerd would reach over plain HTTP untold);
`make push REGISTRY=ADDRESS:PORT/rlkube PUSH_ARGS=--insecure` pushes the operator and core images `make images`
built. The real node's containerd trusts the plain-HTTP registry through a hosts.toml
(tests/cluster/node.py trust_registry), and the shared chart release is upgraded with `imageRegistry` set (and no
image of its own named): the operator pod must come from the registry, and a job naming the project's published
image (ghcr.io/rlkube/core, the CRD's default) must run its role pods from the registry too. The release is put
back as it was, and the pulled images are removed from the node's kept image store, at the end.

Part of `make test` (it adds 70-105 s to the real node's session: the push, the operator's two rollouts and the
job); `make test-registry` runs it alone.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from support.waiting import wait_for
from support import ROOT

pytestmark = pytest.mark.e2e

PUSHED = ("operator", "core")


@pytest.fixture
def registry(tmp_path):
    """docker-registry serving ADDRESS:PORT from tmp_path; yields 'address:port'. ADDRESS is the machine's own (the
    API server's advertised one), not loopback: containerd pulls from a loopback registry over plain HTTP without
    being told, so only a registry on an address another host could use shows that trust_registry is needed."""
    from support.realnode import _host_ip
    from rlkube.local.ports import free_port

    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.fail("docker-registry is not installed: `make deps-apt` installs it (the Makefile's APT_PACKAGES)")
    address, port = _host_ip(), free_port()
    config = tmp_path / "registry.yml"
    config.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
                      f"  delete:\n    enabled: true\nhttp:\n  addr: {address}:{port}\n")
    with open(tmp_path / "registry.log", "wb") as log:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    host = f"{address}:{port}"
    try:
        wait_for(lambda: _get(f"http://{host}/v2/") is not None, 30, "docker-registry to answer /v2/", 0.2)
        yield host
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp_path / "data", ignore_errors=True)  # the pushed images (GBs): pytest keeps tmp_path


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read() or b"{}")
    except OSError:
        return None


def test_make_push_then_the_node_pulls_from_the_registry_with_the_chart_s_one_value(
        registry, real_node, real_api, chart_operator, real_job):
    import helm_python as helm
    from support.helm_chart import CHART
    from support.clusterjob import example
    from kubernetes import client
    from support.realnode import (OPERATOR_IMAGE, OPERATOR_NS, REDIS_IMAGE, RELEASE, diagnostics, lease_holder,
                          operator_pod, webhook_serving)

    prefix = f"{registry}/rlkube"
    t0 = time.monotonic()
    push = subprocess.run(["make", "-s", "push", f"REGISTRY={prefix}", "PUSH_ARGS=--insecure", f"IMAGES={' '.join(PUSHED)}",
                           f"SYSTEM_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert push.returncode == 0, push.stdout[-3000:] + push.stderr[-3000:]
    print(f"\nmake push: {time.monotonic() - t0:.0f}s\n{push.stdout.strip()}")
    for name in PUSHED:
        assert _get(f"http://{registry}/v2/rlkube/{name}/tags/list") == {"name": f"rlkube/{name}", "tags": ["0.1.0"]}

    real_node.trust_registry(registry)
    core = client.CoreV1Api(real_api)
    pulled = [f"{prefix}/{name}:0.1.0" for name in PUSHED]
    with helm.Config(kubeconfig_path=real_node.cp.kubeconfig, namespace=OPERATOR_NS) as helm_config:
        before = helm_config.get_values(RELEASE)
        try:
            # The one value: no image.repository of its own, the default pull policy (the name is not on the node).
            t_upgrade = time.monotonic()
            rel = helm_config.upgrade(CHART, RELEASE, {"imageRegistry": prefix}, namespace=OPERATOR_NS, timeout=60)
            assert rel["status"] == "deployed"
            pod = wait_for(lambda: (p := operator_pod(core)) and p.spec.containers[0].image == pulled[0] and p, 300,
                           lambda: f"the operator pod from {pulled[0]}\n{diagnostics(core, real_node)}", 1)
            assert "--image-registry=" + prefix in pod.spec.containers[0].args
            wait_for(lambda: (lease_holder(real_api) or "").startswith(f"{pod.metadata.name}_"), 120,
                     "the registry's operator to take the Lease", 0.5)

            # A job naming the project's published image (the CRD's default spec.image): its role pods run the
            # registry's core image. Redis stays the local build (a managed Redis is not ours to relocate).
            doc = example(**{"spec.image": "ghcr.io/rlkube/core:0.1.0", "spec.redis.image": REDIS_IMAGE})
            # The new operator pod serves the webhook once the Service's endpoints moved to it (kube-proxy).
            webhook_serving(real_api, real_job.namespace, doc, real_node)
            t_job = time.monotonic()
            real_job.apply(doc)
            job = real_job.wait_phase(timeout=600)
            assert job["status"]["phase"] == "Succeeded", real_job.diagnostics()
            print(f"operator from the registry after {t_job - t_upgrade:.0f}s; the job Succeeded after "
                  f"{time.monotonic() - t_job:.0f}s")
            images = set(real_node.ctr("images", "list", "-q").stdout.split())
            assert set(pulled) <= images, f"{pulled} not pulled by containerd: {sorted(images)}"
            # The kubelet's own word for each role pod: its image came from the registry (pulled, or already
            # present once the first pod had pulled it).
            pulls = {e.involved_object.name for e in core.list_namespaced_event(real_job.namespace).items
                     if e.reason == "Pulled" and f'"{pulled[1]}"' in (e.message or "")}
            roles = {"trainer", "inference", "preprocessor", "actor"}
            assert {real_job.pod(r) for r in roles} <= pulls, f"role pods from {pulled[1]}: {sorted(pulls)}"
        finally:
            helm_config.upgrade(CHART, RELEASE, before, namespace=OPERATOR_NS, timeout=60, reset_values=True)
            wait_for(lambda: (p := operator_pod(core)) and p.spec.containers[0].image == OPERATOR_IMAGE and p, 300,
                     lambda: f"the operator pod back on {OPERATOR_IMAGE}\n{diagnostics(core, real_node)}", 1)
            wait_for(lambda: (p := operator_pod(core)) and (lease_holder(real_api) or "").startswith(
                p.metadata.name + "_"), 120, "the local operator to take the Lease back", 0.5)
            # The node's image store is kept between sessions (tests/cluster/node.py): only the local builds belong
            # there.
            real_node.ctr("images", "rm", *pulled, check=False)
    print(f"registry round trip: {time.monotonic() - t0:.0f}s")
