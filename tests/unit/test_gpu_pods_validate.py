"""The children of examples/multinode-gpu.yaml (2 nodes x 8 GPUs, vLLM with tensor parallel 4), with its megatron
trainer and the same job with the torch trainer, pass `kubernetes-validate --strict` against the Kubernetes 1.32
schemas shipped in the package (offline), with the GPU requests, /dev/shm and the rank env asserted."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from support.pod_security import assert_hardened_pod

from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import builders
from rlkube.controller.manifests.builders import JobRef
from rlkube.contract.parallel import rank_env

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the dev extra installs it

ROOT = Path(__file__).resolve().parents[2]
DOC = next(d for d in yaml.safe_load_all((ROOT / "examples" / "multinode-gpu.yaml").read_text())
           if d and d.get("kind") == "TrainingJob")
K8S = "1.32"


def children(backend: str) -> list[dict]:
    raw = copy.deepcopy(DOC["spec"])
    raw["trainer"]["backend"] = backend
    job = JobRef("team-a", DOC["metadata"]["name"], "0b5c7a8e-6a59-4d2c-9a3c-2f0e8e1d9c11", parse_spec(raw), raw)
    return builders.all_children(job, password="generated-password")


def strict_errors(manifest: dict) -> str | None:
    try:
        kubernetes_validate.validate(manifest, K8S, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return str(exc).splitlines()[0]
    return None


def test_the_schemas_are_shipped_for_1_32():
    # Offline: validation of a known-bad pod fails from the bundled schema, no download involved.
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "c", "image": "i", "unknownField": 1}]}}
    assert "unknownField" in strict_errors(bad)


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_every_child_passes_strict_validation_for_kubernetes_1_32(backend):
    kids = children(backend)
    assert {k["kind"] for k in kids} == {"ConfigMap", "Secret", "NetworkPolicy", "Service", "Pod"}
    for manifest in kids:
        assert strict_errors(manifest) is None, (manifest["kind"], manifest["metadata"]["name"],
                                                 strict_errors(manifest))


@pytest.mark.parametrize("backend", ["megatron", "torch"])
def test_gpu_requests_shm_and_rank_env(backend):
    pods = {k["metadata"]["name"]: k for k in children(backend) if k["kind"] == "Pod"}
    name = DOC["metadata"]["name"]
    spec = parse_spec(DOC["spec"])
    for node in (0, 1):
        pod = pods[f"{name}-trainer-{node}"]
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["requests"]["nvidia.com/gpu"] == 8
        assert c["command"] == ["python", "-m", "rlkube.core.launch.ranks"]  # 8 ranks per pod
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert (env["WORLD_SIZE"], env["NNODES"], env["NODE_RANK"], env["LOCAL_WORLD_SIZE"]) == ("16", "2", str(node), "8")
        assert env["MASTER_ADDR"] == f"{name}-trainer-0.{name}-trainer" and env["MASTER_PORT"] == "29400"
        ranks = [dict(rank_env(spec, node, local)) for local in range(8)]
        assert [int(r["RANK"]) for r in ranks] == list(range(node * 8, node * 8 + 8))
        assert [int(r["LOCAL_RANK"]) for r in ranks] == list(range(8))
        # The operator's memory-backed /dev/shm, sized by the example's template; its placement merged in.
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert pod["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert env["NCCL_DEBUG"] == "WARN"
        anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
        assert_hardened_pod(pod, DOC["spec"])
    for replica in (0, 1):
        pod = pods[f"{name}-inference-{replica}"]
        (c,) = pod["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 4  # tensorParallel
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert_hardened_pod(pod, DOC["spec"])
    for actor in (p for n, p in pods.items() if "-actor-" in n):
        assert "nvidia.com/gpu" not in str(actor["spec"]["containers"][0].get("resources"))
