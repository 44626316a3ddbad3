"""What changed in a TrainingJob's spec since the job started, and the spec a running job keeps acting on.

A running job is not rolled: its pods read the spec it started with (the ConfigMap), so the operator keeps
deciding by that spec too (maxSteps, timeouts, grace periods) and only tells the user that a change was
ignored. The one field acted on live is `runPolicy.suspend`; a resume starts from the new spec. Pure dict
functions over the camelCase spec as the API server stores it (its defaults applied), no I/O.
"""

from __future__ import annotations

import copy
from typing import Any

LIVE_PATHS = ("spec.runPolicy.suspend",)
"""Spec fields acted on while the job runs; a change anywhere else is ignored (and reported)."""


def _leaves(node: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            _leaves(value, f"{prefix}.{key}", out)
    else:
        out[prefix] = node  # a scalar, a list (compared whole) or an empty mapping


def changed_paths(started: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Dotted paths (`spec.algorithm.maxSteps`) whose value differs, was added or removed, sorted; the live
    fields (suspend) excepted. A path that became a mapping, or stopped being one, is named once."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    _leaves(started, "spec", before)
    _leaves(current, "spec", after)
    changed = {path for path in before.keys() | after.keys() if before.get(path, _MISSING) != after.get(path, _MISSING)}
    return sorted(path for path in changed if path not in LIVE_PATHS)


_MISSING = object()


def with_live_fields(started: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """The spec to act on: the one the job started with, with the live fields taken from `current`."""
    out = copy.deepcopy(started)
    run_policy = out.setdefault("runPolicy", {})
    live = (current.get("runPolicy") or {}).get("suspend")
    if live is None:
        run_policy.pop("suspend", None)
    else:
        run_policy["suspend"] = live
    return out


def describe(paths: list[str]) -> str:
    return ", ".join(paths)
