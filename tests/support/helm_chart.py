"""Test helpers for charts/rlkube: render it with the Helm SDK and look objects up in the result.

The Helm v4 SDK (`helm-python-sdk`, Go's Helm compiled into a shared library) renders exactly as
`helm template` would, with the chart's values.schema.json applied; no helm binary is needed.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import yaml
from support import ROOT


CHART = ROOT / "charts" / "rlkube"


def render(values: dict[str, Any] | None = None, *, release: str = "rel", namespace: str = "rlkube-system") -> list[dict]:
    """Every object the chart's templates produce (CRDs in crds/ are not templates and are not included)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values=values or {}, name=release, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(out):
        if not path.endswith(".yaml"):
            continue
        docs += [d for d in yaml.safe_load_all(out[path]) if d]
    return docs


def find(docs: list[dict], kind: str, name: str | None = None, namespace: str | None = None) -> list[dict]:
    return [
        d for d in docs
        if d["kind"] == kind
        and (name is None or d["metadata"]["name"] == name)
        and (namespace is None or d["metadata"].get("namespace") == namespace)
    ]


def one(docs: list[dict], kind: str, name: str | None = None, namespace: str | None = None) -> dict:
    found = find(docs, kind, name, namespace)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def operator_container(docs: list[dict]) -> dict:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def rules_allow(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    """Whether RBAC rules grant `verb` on `group`/`resource` (resource may be `name/subresource`)."""
    for rule in rules:
        if (group in rule.get("apiGroups", []) or "*" in rule.get("apiGroups", [])) and (
            resource in rule.get("resources", []) or "*" in rule.get("resources", [])
        ) and (verb in rule.get("verbs", []) or "*" in rule.get("verbs", [])):
            return True
    return False


# What the operator does in a namespace it watches (group, resource, verb); the chart's RBAC must grant all of it.
OPERATOR_NEEDS = [
    *[("rlkube.io", "trainingjobs", v) for v in ("get", "list", "watch", "patch", "update", "delete")],
    *[("rlkube.io", "trainingjobs/status", v) for v in ("get", "patch", "update")],
    ("rlkube.io", "trainingjobs/finalizers", "update"),
    *[("", r, v) for r in ("pods", "services", "secrets", "configmaps")
      for v in ("get", "list", "watch", "create", "patch", "delete")],
    *[("networking.k8s.io", "networkpolicies", v) for v in ("get", "list", "watch", "create", "patch", "delete")],
    ("", "pods/status", "get"),
    *[("", "persistentvolumeclaims", v) for v in ("get", "list", "watch")],
    *[(g, "events", v) for g in ("", "events.k8s.io") for v in ("create", "patch")],
    *[("kueue.x-k8s.io", "workloads", v) for v in ("get", "list", "watch", "create", "patch")],
    *[("kueue.x-k8s.io", "workloads/status", v) for v in ("get", "patch", "update")],
]
# What kopf itself needs cluster-wide in every mode (it follows CRDs to find the TrainingJob resource).
FRAMEWORK_NEEDS = [("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("get", "list", "watch")] + [
    # ... and the operator reads Kueue's ResourceFlavors (cluster-scoped) named in a Workload's admission.
    ("kueue.x-k8s.io", "resourceflavors", v) for v in ("get", "list", "watch")
]
# What kopf needs cluster-wide when it watches a list of namespaces (it follows which of them exist);
# a cluster-wide kopf never reads namespaces.
NAMESPACE_OBSERVATION = [("", "namespaces", v) for v in ("get", "list", "watch")]
# What the operator never does: the chart must not grant it.
NOT_NEEDED = [
    ("rlkube.io", "trainingjobs", "create"),
    ("apps", "deployments", "create"),
    ("batch", "jobs", "create"),
    ("", "nodes", "delete"),
    ("", "pods/exec", "create"),
    ("", "pods/status", "patch"),
    ("", "serviceaccounts", "create"),
    ("", "persistentvolumeclaims", "delete"),
    ("", "persistentvolumeclaims", "create"),
    ("rbac.authorization.k8s.io", "clusterroles", "update"),
    ("rbac.authorization.k8s.io", "rolebindings", "create"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "update"),
]
