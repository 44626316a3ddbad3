"""Every document of every manifest in examples/ is accepted by the real kube-apiserver, and nothing in it is
pruned: the API server silently drops fields the CRD schema does not know, so a misspelt field in an example
would otherwise be accepted and ignored."""

from __future__ import annotations


import pytest
import yaml
from kubernetes.dynamic import DynamicClient

from rlkube.lifecycle.validation import parse_manifest
from rlkube.api.spec import KIND
from support import specs
from support import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _pruned(sent, got, path="") -> list[str]:
    """Paths in `sent` that the server did not keep (defaults it added are fine)."""
    if isinstance(sent, dict):
        out = []
        for key, value in sent.items():
            if not isinstance(got, dict) or key not in got:
                out.append(f"{path}.{key}")
            else:
                out += _pruned(value, got[key], f"{path}.{key}")
        return out
    if isinstance(sent, list):
        if not isinstance(got, list) or len(got) != len(sent):
            return [path]
        return [p for i, (s, g) in enumerate(zip(sent, got)) for p in _pruned(s, g, f"{path}[{i}]")]
    # Numbers may come back as another numeric type (1.0 -> 1); compare values.
    return [] if sent == got else [f"{path}: {sent!r} -> {got!r}"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(api_client, crd, namespace, path):
    dyn = DynamicClient(api_client)
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        res = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        created = res.create(body=doc, namespace=namespace).to_dict()
        assert created["metadata"]["namespace"] == namespace
        if doc["kind"] == KIND:
            lost = _pruned(doc["spec"], created["spec"], "spec")
            assert not lost, f"{path.name}: the API server pruned {lost} (not in the CRD schema)"
            # What the server stored, defaults included, is still a valid job for the operator.
            meta, spec = parse_manifest(created)
            assert meta["name"] == doc["metadata"]["name"]
            assert spec.algorithm.max_steps == doc["spec"]["algorithm"]["maxSteps"]
        else:
            assert not _pruned(doc.get("spec", {}), created.get("spec", {}), "spec"), doc["kind"]


def test_a_misspelt_field_would_be_caught(api_client, crd, namespace):
    # The pruning check above can fail: a typo in a spec comes back pruned.
    doc = specs.document(**{"metadata.name": "typo", "spec.trainer.checkpont": {"intervalSteps": 5}})
    created = DynamicClient(api_client).resources.get(api_version=doc["apiVersion"], kind=KIND).create(
        body=doc, namespace=namespace
    ).to_dict()
    assert _pruned(doc["spec"], created["spec"], "spec") == ["spec.trainer.checkpont"]
