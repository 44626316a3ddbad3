"""How kopf decodes our watch streams: with orjson, each object trimmed to what the operator reads.

kopf decodes every line of every watch stream (every TrainingJob status write, every pod change) and keeps the
object while that object's worker runs (a pod's for a few seconds, a TrainingJob's for as long as its daemon). At
scale these copies are most of the operator's memory, and most of each copy is never read:

- `metadata.managedFields`: half of a TrainingJob's JSON and 40% of a pod's. Decoded, a 10 KB TrainingJob takes
  52 KB of Python objects (23 KB without them), a 17 KB pod 73 KB (33 KB). client-go's informers drop them the
  same way (SharedInformer.SetTransform; controller-runtime ships cache.TransformStripManagedFields).
- kubectl's `last-applied-configuration` annotation: one more copy of the spec of every applied object.
- a Pod's `spec`: the operator built it; it reads pods only through observed.pod_view (metadata and status).
- the `data` of ConfigMaps and Secrets: they are indexed by their labels alone (handlers.STATIC_KINDS), and a
  Secret's content has no business in the operator's memory.

Only watch events are trimmed (kopf's initial listing and its PATCH responses are decoded elsewhere, whole).
"""

from __future__ import annotations

import json
import types
from typing import Any

import orjson

LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
DROPPED_BY_KIND = {
    "Pod": ("spec",),
    "ConfigMap": ("data", "binaryData"),
    "Secret": ("data", "stringData"),
}
"""Top-level fields dropped from watched objects of a kind (everything else is kept)."""


def trim(obj: Any) -> Any:
    """The object without what no handler reads (in place; anything not an object is returned as it is)."""
    if not isinstance(obj, dict):
        return obj
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if isinstance(annotations, dict):
            annotations.pop(LAST_APPLIED, None)
    for key in DROPPED_BY_KIND.get(obj.get("kind"), ()):
        obj.pop(key, None)
    return obj


def loads(data: bytes | str) -> Any:
    """A watch line decoded (orjson) and its object trimmed."""
    event = orjson.loads(data)
    if isinstance(event, dict):
        trim(event.get("object"))
    return event


def install() -> bool:
    """Point kopf's watch decoding at `loads`.

    kopf looks `json` up in its API client module at call time, and uses it there only for watch lines. Where a
    kopf version no longer decodes there, nothing is changed (False) and kopf keeps its own decoding.
    """
    from kopf._cogs.clients import api as kopf_api

    current = getattr(kopf_api, "json", None)
    if current is not json:
        return getattr(current, "loads", None) is loads  # already done (True) or not kopf's layout
    kopf_api.json = types.SimpleNamespace(loads=loads)
    return True
