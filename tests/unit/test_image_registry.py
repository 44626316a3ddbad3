"""One registry setting relocates the project's published images, and only those (lifecycle/image_reference.py).

The operator's `--image-registry` (the chart's `imageRegistry`) makes the role pods of a job that names
ghcr.io/rlkube/... (the CRD's default spec.image, the examples) pull from the user's registry; an image of the
user's own is used as written. images/build.py --push writes the images where that rule looks for them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from support import specs
from rlkube.controller.manifests import builders
from rlkube.controller.manifests.builders import JobRef
from rlkube.lifecycle.image_reference import relocate
from rlkube.lifecycle.validation import parse_spec

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("image, registry, expected", [
    ("ghcr.io/rlkube/core:0.1.0", "127.0.0.1:5000/rlkube", "127.0.0.1:5000/rlkube/core:0.1.0"),
    ("ghcr.io/rlkube/vllm:0.1.0-cpu", "registry.example.com/team/", "registry.example.com/team/vllm:0.1.0-cpu"),
    ("ghcr.io/rlkube/core:0.1.0", None, "ghcr.io/rlkube/core:0.1.0"),
    ("registry.example.com/acme/policy-vllm:1", "127.0.0.1:5000/rlkube", "registry.example.com/acme/policy-vllm:1"),
    ("redis:7-alpine", "127.0.0.1:5000/rlkube", "redis:7-alpine"),
    ("ghcr.io/rlkubex/core:1", "r.example.com/x", "ghcr.io/rlkubex/core:1"),
])
def test_relocate(image, registry, expected):
    assert relocate(image, registry) == expected


def test_the_operator_s_role_pods_use_the_registry(monkeypatch):
    raw = specs.spec()  # examples/tiny-cpu.yaml: spec.image ghcr.io/rlkube/core:0.1.0
    raw["redis"] = {**raw.get("redis", {}), "image": "registry.example.com/own/redis:7"}
    job = JobRef("ns", "tj", "uid-1", parse_spec(raw), raw)
    monkeypatch.setattr(builders, "IMAGE_REGISTRY", "127.0.0.1:5000/rlkube")
    for role in ("trainer", "inference", "actor", "preprocessor"):
        pod = builders.core_pod(job, role, 0)
        images = {c["image"] for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", [])}
        assert images == {"127.0.0.1:5000/rlkube/core:0.1.0"}, role
    assert builders.redis_pod(job)["spec"]["containers"][0]["image"] == "registry.example.com/own/redis:7"
    monkeypatch.setattr(builders, "IMAGE_REGISTRY", None)
    assert builders.core_pod(job, "trainer", 0)["spec"]["containers"][0]["image"] == "ghcr.io/rlkube/core:0.1.0"


def _build_module():
    spec = importlib.util.spec_from_file_location("images_build", ROOT / "images" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_push_writes_the_layout_the_registry_setting_reads():
    build = _build_module()
    for name, image in build.IMAGES.items():
        pushed = build.push_target(image, "127.0.0.1:5000/rlkube")
        # What the chart's imageRegistry makes the operator pull for the published name of the same image.
        published = "ghcr.io/rlkube/" + image.tag.rsplit("/", 1)[-1]
        assert relocate(published, "127.0.0.1:5000/rlkube") == pushed, name
