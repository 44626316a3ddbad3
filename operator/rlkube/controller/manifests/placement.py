"""Where a queue admitted a role's pods: node selector and tolerations, merged into a pod the builders made.

Kueue's admission names a ResourceFlavor per resource of each pod set; a flavour carries node labels and
tolerations that Kueue's own job integrations copy into the pods (kueue pkg/podset FromAssignment + Merge).
This module holds only the value and the merge, so builders.pod applies it at one call site.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Placement:
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()


def with_placement(pod: dict, placement: Placement | None) -> dict:
    """`pod` with the admission's node selector and tolerations added.

    The admission wins on a nodeSelector key both set (Kueue chose the flavour knowing the pod's own selector);
    a toleration already on the pod is not added twice."""
    if placement is None or (not placement.node_selector and not placement.tolerations):
        return pod
    out = copy.deepcopy(pod)
    spec = out["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        tolerations = list(spec.get("tolerations") or [])
        tolerations += [t for t in placement.tolerations if t not in tolerations]
        spec["tolerations"] = tolerations
    return out
