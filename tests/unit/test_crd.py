"""The committed CRD equals `rlkube crd`, and the generated schema says what the API server must enforce."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlkube.lifecycle.validation import SpecError, parse_manifest
from rlkube.api.crd import crd, crd_yaml
from support import specs

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_generator():
    committed = (ROOT / "crds" / "rlkube.io_trainingjobs.yaml").read_text()
    assert committed == crd_yaml(), "crds/ drifted from rlkube.api: run `rlkube crd > crds/rlkube.io_trainingjobs.yaml`"


def test_cli_prints_the_same_crd():
    out = subprocess.run([sys.executable, "-m", "rlkube.cli", "crd"], capture_output=True, text=True, check=True)
    assert out.stdout == crd_yaml()


def _spec_schema():
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_schema_is_structural_and_typed():
    def walk(node, path):
        assert "$ref" not in node and "anyOf" not in node, path
        # OpenAPI v3.0: an exclusive bound is a boolean beside minimum/maximum (a number is JSON Schema 2020's form,
        # which the API server refuses: it refused the whole CRD once, over spec.trainer.lora.dropout's).
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in node:
                assert node[bound] is True and limit in node, (path, bound, node)
        if "properties" in node:
            assert node.get("type") == "object", path
            for name, sub in node["properties"].items():
                walk(sub, f"{path}.{name}")
        elif not node.get("x-kubernetes-int-or-string") and not node.get("x-kubernetes-preserve-unknown-fields"):
            assert "type" in node, path
            assert node.get("description") or path.count(".") > 3, f"{path} has no description"

    walk(_spec_schema(), "spec")


def test_schema_carries_constraints():
    spec = _spec_schema()
    assert set(spec["required"]) == {"model", "algorithm"}
    algo = spec["properties"]["algorithm"]["properties"]
    assert algo["maxSteps"]["minimum"] == 1
    assert spec["properties"]["algorithm"]["required"] == ["maxSteps"]
    assert algo["loss"]["enum"] == ["grpo", "gspo", "ppo", "reinforce", "sft"]
    assert algo["learningRate"]["exclusiveMinimum"] is True
    dropout = spec["properties"]["trainer"]["properties"]["lora"]["properties"]["dropout"]
    assert (dropout["maximum"], dropout["exclusiveMaximum"]) == (1, True)
    assert spec["properties"]["actor"]["properties"]["replicas"]["minimum"] == 1
    assert spec["properties"]["trainer"]["properties"]["backend"]["default"] == "torch"
    assert spec["properties"]["model"]["required"] == ["path"]
    version = crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert crd()["spec"]["names"]["shortNames"] == ["tj"]
    assert [c["name"] for c in version["additionalPrinterColumns"]][:3] == ["Phase", "Step", "Lag"]


def test_example_parses():
    doc = specs.document()
    meta, spec = parse_manifest(doc)
    assert meta["name"] == "tiny-cpu"
    assert spec.algorithm.max_steps == 40 and spec.inference.engine == "native"


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"redis": {"mode": "external"}}, "spec.redis.url"),
        ({"model": {"path": "builtin://tiny-gpt"}}, "spec.model.path"),
        ({"model": {"path": "hf://just-a-name"}}, "spec.model.path"),
        ({"model": {"path": "s3://bucket/model"}}, "spec.model.path"),
        ({"algorithm": {"maxSteps": 3, "warmupSteps": 3, "lrSchedule": "cosine"}}, "spec.algorithm.warmupSteps"),
        ({"algorithm": {"maxSteps": 3, "groupSize": 1}}, "spec.algorithm.groupSize"),
        ({"trainer": {"backend": "fast-llm"}}, "spec.trainer.gpusPerNode"),
        ({"algorithm": {"maxSteps": 0}}, "spec.algorithm.maxSteps"),
        ({"bogusField": 1}, "spec.bogusField"),
    ],
)
def test_operator_side_validation_names_the_field(patch, field):
    doc = specs.document()
    doc["spec"].update(patch)
    with pytest.raises(SpecError) as err:
        parse_manifest(doc)
    assert field in [e.field for e in err.value.errors], str(err.value)
