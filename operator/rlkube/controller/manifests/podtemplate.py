"""Merges a role's pod template override (`spec.<role>.template`) into the pod the builders made. Pure.

The rules, as JobSet and KubeRay users expect them from a partial PodTemplateSpec (strategic-merge-like):
- `metadata.labels` / `annotations`: added to the operator's (its own keys are refused by validation);
- `spec.nodeSelector`: merged key by key, the template's value wins;
- `spec.tolerations`: added after the operator's;
- `spec.affinity`: each key the template gives (nodeAffinity, podAffinity, podAntiAffinity) replaces the
  operator's of that key (the trainer's one-pod-per-node podAntiAffinity, for example);
- `spec.topologySpreadConstraints`: merged by topologyKey, the template's wins;
- `spec.imagePullSecrets`: merged by name;
- `spec.priorityClassName`, `serviceAccountName`, `runtimeClassName`, `automountServiceAccountToken`: set (the
  operator's false gives way to a template's true);
- `spec.securityContext` and the container's `securityContext`: merged field by field over the hardened
  defaults (a nested object such as `capabilities` or `seccompProfile` is replaced whole);
- `spec.volumes`: merged by name: added, or replacing the operator's `tmp` / `dshm`;
- `spec.containers[<role>]`: `env` merged by name (added after the operator's, so `$(VAR)` may refer to the
  operator's variables; replaces a default such as HOME), `volumeMounts` merged by mountPath.
What the operator owns (the rank env, the Redis password, addresses, the command, its labels, the job config and
checkpoint volumes) never reaches this module: `rlkube.lifecycle.validation.template_errors` refuses it first.
"""

from __future__ import annotations

import copy
from typing import Any

from rlkube.api.pod_template import PodTemplate


def _dump(model) -> Any:
    return model.model_dump(by_alias=True, exclude_unset=True, exclude_none=True)  # as written


def _merge_by(ours: list[dict], theirs: list[dict], key: str) -> list[dict]:
    """`ours` with each of `theirs` replacing the entry of the same `key` in place, the rest appended in order."""
    out = list(ours)
    index = {item.get(key): i for i, item in enumerate(out)}
    for item in theirs:
        if item.get(key) in index:
            out[index[item.get(key)]] = item
        else:
            index[item.get(key)] = len(out)
            out.append(item)
    return out


def _fields(ours: dict | None, theirs: dict) -> dict:
    return {**(ours or {}), **theirs}


def apply(pod: dict, template: PodTemplate | None) -> dict:
    """A copy of `pod` with `template` merged in (the pod itself is untouched); `pod` when there is none."""
    if template is None:
        return pod
    pod = copy.deepcopy(pod)
    meta, spec = pod["metadata"], pod["spec"]
    tpl = _dump(template)
    t_meta, t_spec = tpl.get("metadata", {}), tpl.get("spec", {})
    for kind in ("labels", "annotations"):
        if t_meta.get(kind):
            # The operator's keys last: validation refuses a template that names them, this keeps them regardless.
            meta[kind] = {**t_meta[kind], **meta.get(kind, {})}
    if t_spec.get("nodeSelector"):
        spec["nodeSelector"] = _fields(spec.get("nodeSelector"), t_spec["nodeSelector"])
    if t_spec.get("tolerations"):
        spec["tolerations"] = [*spec.get("tolerations", []), *t_spec["tolerations"]]
    if t_spec.get("affinity"):
        spec["affinity"] = _fields(spec.get("affinity"), t_spec["affinity"])
    if t_spec.get("topologySpreadConstraints"):
        spec["topologySpreadConstraints"] = _merge_by(spec.get("topologySpreadConstraints", []),
                                                      t_spec["topologySpreadConstraints"], "topologyKey")
    if t_spec.get("imagePullSecrets"):
        spec["imagePullSecrets"] = _merge_by(spec.get("imagePullSecrets", []), t_spec["imagePullSecrets"], "name")
    for name in ("priorityClassName", "serviceAccountName", "runtimeClassName", "automountServiceAccountToken"):
        if name in t_spec:
            spec[name] = t_spec[name]
    if t_spec.get("securityContext"):
        spec["securityContext"] = _fields(spec.get("securityContext"), t_spec["securityContext"])
    if t_spec.get("volumes"):
        spec["volumes"] = _merge_by(spec.get("volumes", []), t_spec["volumes"], "name")
    for override in t_spec.get("containers", []):
        container = next((c for c in spec["containers"] if c["name"] == override["name"]), None)
        if container is None:  # validation allows only the role's own container
            raise ValueError(f"no container {override['name']!r} in pod {meta['name']}")
        if override.get("env"):
            container["env"] = _merge_by(container.get("env", []), override["env"], "name")
        if override.get("volumeMounts"):
            container["volumeMounts"] = _merge_by(container.get("volumeMounts", []), override["volumeMounts"],
                                                  "mountPath")
        if override.get("securityContext"):
            container["securityContext"] = _fields(container.get("securityContext"), override["securityContext"])
    return pod
