"""Generates the TrainingJob CustomResourceDefinition from the pydantic types.

Pydantic emits JSON Schema 2020-12 with `$ref`s and `anyOf` for optionals; Kubernetes wants a *structural*
OpenAPI v3.0 schema (no refs, one type per node, `exclusiveMinimum`/`exclusiveMaximum` as booleans). The
conversion is small and specific to the shapes our types use, so it is written here rather than pulled from a library.
"""

from __future__ import annotations

from typing import Any

import yaml

from rlkube.api.spec import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION, TrainingJobSpec
from rlkube.api.status import TrainingJobStatus

_DROP = {"title", "$defs"}


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


_SCALARS = {"integer", "string", "number", "boolean"}


def _scalar(node: dict[str, Any], defs: dict[str, Any]) -> bool:
    """A scalar type, or a union of scalar types."""
    node = _resolve(node, defs)
    return node.get("type") in _SCALARS or ("anyOf" in node and all(_scalar(v, defs) for v in node["anyOf"]))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = _resolve(node, defs)
    if "anyOf" in node:
        variants = [_resolve(v, defs) for v in node["anyOf"]]
        non_null = [v for v in variants if v.get("type") != "null"]
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(non_null) == 1:
            # Optional[X]: absent means None; the API server never sees an explicit null from us.
            out = _convert({**non_null[0], **rest}, defs)
            if out.get("default", "") is None:
                del out["default"]
            return out
        if {v.get("type") for v in non_null} == {"integer", "string"}:
            return {"x-kubernetes-int-or-string": True, **_scalar_extras(rest)}
        if all(_scalar(v, defs) or (v.get("type") == "array" and _scalar(v.get("items", {}), defs))
               for v in non_null):
            # A scalar of any of these kinds, or a list of them (task params, reasoning-gym configs): keep what
            # the user wrote.
            return {"x-kubernetes-preserve-unknown-fields": True, **_scalar_extras(rest)}
        raise ValueError(f"unsupported union in schema: {node}")

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            required = set(node.get("required", ()))
            out["properties"] = {}
            for name, sub in value.items():
                conv = _convert(sub, defs)
                if conv.get("type") == "object" and name not in required and "anyOf" not in sub:
                    # A sub-object with a default factory: `{}` lets the API server fill its nested defaults.
                    conv.setdefault("default", {})
                out["properties"][name] = conv
        elif key == "items":
            out["items"] = _convert(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _convert(value, defs)
        elif key == "additionalProperties":
            continue  # `extra="forbid"` -> false; structural schemas prune unknown fields instead
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema 2020 gives the bound; OpenAPI v3.0 (the API server's) a boolean beside minimum/maximum.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    return out


def _scalar_extras(node: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in node.items() if k in ("description", "default")}


def openapi_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(raw, raw.get("$defs", {}))


def _without_defaults(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_without_defaults(v) for v in node]
    return node


# `kubectl get tj` as the API server prints it (a server-side Table): every cell is a status field the operator
# writes from what it observed, never conditions[-1]. Priority 1 columns show with `-o wide`.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase",
     "description": "Pending, Starting, Running, Draining, Succeeded, Failed or Suspended."},
    {"name": "Step", "type": "string", "jsonPath": ".status.progress",
     "description": "Last optimizer step the trainer reported / spec.algorithm.maxSteps."},
    {"name": "Lag", "type": "integer", "jsonPath": ".status.lag",
     "description": "Weight versions between the trainer and the oldest rollout of its last step."},
    {"name": "Reward", "type": "number", "jsonPath": ".status.trainer.rewardMean",
     "description": "Mean reward of the last step's training documents."},
    {"name": "Eval", "type": "number", "jsonPath": ".status.trainer.evalRewardMean", "priority": 1,
     "description": "Mean reward over the held-out eval set at the last evaluated version (spec.evaluation)."},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.trainer.tokensPerSecond", "priority": 1,
     "description": "Tokens trained per second in the last step."},
    {"name": "Backend", "type": "string", "jsonPath": ".spec.trainer.backend", "priority": 1,
     "description": "Training backend."},
    {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1,
     "description": "Reason of the current phase."},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp",
     "description": "Time since the TrainingJob was created."},
]


def crd() -> dict[str, Any]:
    spec_schema = openapi_schema(TrainingJobSpec)
    # Only the operator writes status; defaults there would invent values it never reported.
    status_schema = _without_defaults(openapi_schema(TrainingJobStatus))
    status_schema.pop("required", None)
    # kopf keeps its own bookkeeping under status; known fields are still validated.
    status_schema["x-kubernetes-preserve-unknown-fields"] = True
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["rlkube"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [dict(c) for c in PRINTER_COLUMNS],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An LLM reinforcement-learning job run PipelineRL-style.",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string", "description": f"{GROUP}/{VERSION}."},
                                "kind": {"type": "string", "description": f"{KIND}."},
                                "metadata": {"type": "object"},  # the API server allows nothing else here
                                "spec": spec_schema,
                                "status": status_schema,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `rlkube crd` from rlkube.api; do not edit (tests/unit/test_crd.py checks drift).\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
