"""Every manifest in examples/ passes `rlkube validate` and says what examples/README.md says it does.

The same files are created on a real kube-apiserver in tests/integration/apiserver/test_examples_apiserver.py.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from rlkube.lifecycle.validation import parse_manifest
from rlkube.api.spec import API_VERSION, KIND
from support import specs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGES = {p.parent.name for p in (ROOT / "images").glob("*/Dockerfile")}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _jobs(path: Path):
    return [parse_manifest(d) for d in _docs(path) if d.get("kind") == KIND]


def test_the_examples_the_readme_promises():
    names = {p.name for p in EXAMPLES}
    assert {"tiny-cpu.yaml", "vllm-cpu.yaml", "external-redis.yaml", "fast-llm.yaml", "multinode-gpu.yaml"} <= names
    readme = (ROOT / "examples" / "README.md").read_text()
    for name in names:
        assert f"`{name}`" in readme, f"examples/README.md does not describe {name}"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_rlkube_validate_accepts_it(path):
    out = subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    jobs = _jobs(path)
    assert len(jobs) == 1, f"{path.name}: one TrainingJob per example"
    assert f"{jobs[0][0]['name']}: valid" in out.stdout
    for doc in _docs(path):
        assert doc["apiVersion"] == API_VERSION or doc["kind"] != KIND


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_images_are_ours_at_this_release_or_derived(path):
    (meta, spec), = _jobs(path)
    for role in ("trainer", "inference", "actor", "preprocessor"):
        image = spec.image_for(role)
        repo, _, tag = image.rpartition(":")
        if repo.startswith("ghcr.io/rlkube/"):
            assert repo.rsplit("/", 1)[1] in IMAGES, f"{path.name}: {role} image {image} is not built by images/"
            assert tag.split("-")[0] == VERSION, f"{path.name}: {role} image {image} is not release {VERSION}"
        else:
            # A derived image (model weights baked in); examples/README.md shows how to build it.
            assert repo.startswith("registry.example.com/"), f"{path.name}: {role} image {image}"


def test_each_example_shows_what_it_is_named_for():
    jobs = {p.name: _jobs(p)[0][1] for p in EXAMPLES}
    gpu = jobs["multinode-gpu.yaml"]
    assert gpu.trainer.backend == "megatron" and gpu.trainer.nodes == 2 and gpu.trainer.gpus_per_node == 8
    assert gpu.inference.engine == "vllm" and gpu.inference.tensor_parallel > 1
    assert gpu.trainer.checkpoint.claim_name
    assert "trainer-megatron" in gpu.trainer.image and "vllm" in gpu.inference.image
    cpu_vllm = jobs["vllm-cpu.yaml"]
    assert cpu_vllm.inference.engine == "vllm" and cpu_vllm.inference.image.endswith("-cpu")
    assert cpu_vllm.trainer.gpus_per_node == 0
    ext = jobs["external-redis.yaml"]
    assert ext.redis.mode == "external" and ext.redis.url and ext.redis.password_secret
    fast = jobs["fast-llm.yaml"]
    assert fast.trainer.backend == "fast-llm" and fast.redis.mode == "managed" and "fast-llm" in fast.trainer.image


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_referenced_secrets_and_claims_ship_with_the_example(path):
    docs = _docs(path)
    (meta, spec), = _jobs(path)
    shipped = {(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] != KIND}
    if spec.redis.password_secret:
        secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == spec.redis.password_secret.name)
        assert spec.redis.password_secret.key in secret.get("stringData", {}) | secret.get("data", {})
    if spec.trainer.checkpoint.claim_name:
        assert ("PersistentVolumeClaim", spec.trainer.checkpoint.claim_name) in shipped
        if spec.trainer.nodes > 1:
            claim = next(d for d in docs if d["kind"] == "PersistentVolumeClaim")
            assert "ReadWriteMany" in claim["spec"]["accessModes"], "several trainer pods mount the claim"


def test_validate_skips_other_kinds_but_checks_misspelt_jobs(tmp_path):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"password": "x"}}
    job = specs.document()
    only_secret = tmp_path / "secret.yaml"
    only_secret.write_text(yaml.safe_dump(secret))
    out = subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(only_secret)], capture_output=True, text=True)
    assert out.returncode == 1 and "no TrainingJob" in out.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump_all([secret, {**job, "kind": "TrainingJobs"}]))
    out = subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(typo)], capture_output=True, text=True)
    assert out.returncode == 1 and "kind: must be TrainingJob" in out.stderr


def test_validate_refuses_what_the_operator_refuses_before_any_child(tmp_path):
    """An image the kubelet cannot parse, and a name too long for the job's children: `rlkube validate` refuses
    both naming the field, as the operator does (the same rules), instead of calling the manifest valid."""
    for overrides, says in [({"spec.actor.image": "my image:latest"}, "spec.actor.image: 'my image:latest' is not "
                                                                      "an image reference"),
                            ({"metadata.name": "j" * 60}, "metadata.name: '" + "j" * 60 + "' is too long")]:
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(specs.document(**overrides)))
        out = subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(path)], capture_output=True,
                             text=True)
        assert out.returncode == 1 and says in out.stderr, out.stderr
        assert "valid" not in out.stdout
