"""A container's environment as kubelet builds it: envFrom, env with valueFrom, and $(VAR) expansion.

Pure functions (no API calls): Secrets and ConfigMaps come in through a `lookup(kind, namespace, name)`
callable, so the rules can be unit-tested and the agent decides how to fetch. The expansion follows
kubelet's `third_party/forked/golang/expansion`: `$(VAR)` is replaced when VAR is defined earlier, left
as is otherwise; `$$` is an escaped `$`. Command and args are expanded with the final environment.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Mapping

from kubernetes.utils import parse_quantity

Lookup = Callable[[str, str, str], "dict[str, str] | None"]  # (kind, namespace, name) -> data or None

_FIELD_LABEL = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


class ConfigError(Exception):
    """The container cannot be created yet (kubelet's CreateContainerConfigError); retried later."""


def expand(text: str, env: Mapping[str, str]) -> str:
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 == n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : close]
                out.append(env.get(name, f"$({name})"))
                i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def secret_data(secret: dict) -> dict[str, str]:
    """A Secret's `data` decoded (and `stringData`, which a Secret read back never has but a test may)."""
    data = {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def configmap_data(cm: dict) -> dict[str, str]:
    data = dict(cm.get("data") or {})
    for k, v in (cm.get("binaryData") or {}).items():
        data[k] = base64.b64decode(v).decode("utf-8", errors="replace")
    return data


def field_value(pod: dict, path: str, pod_ip: str | None, host_ip: str | None) -> str:
    meta, spec = pod.get("metadata", {}), pod.get("spec", {})
    m = _FIELD_LABEL.match(path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
    }
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return "" if simple[path] is None else str(simple[path])


def resource_value(container: dict, ref: dict, node_allocatable: Mapping[str, str]) -> str:
    """resourceFieldRef: limits fall back to the node's allocatable, as kubelet does."""
    resource = ref.get("resource", "")
    section, _, name = resource.partition(".")
    resources = container.get("resources") or {}
    value = (resources.get(section) or {}).get(name)
    if value is None and section == "requests":
        value = (resources.get("limits") or {}).get(name)
    if value is None:
        value = node_allocatable.get(name)
    if value is None:
        raise ConfigError(f"resourceFieldRef {resource!r}: no value")
    divisor = parse_quantity(str(ref.get("divisor") or "1"))
    return str(math.ceil(parse_quantity(str(value)) / divisor))


def _ref_data(lookup: Lookup, kind: str, ns: str, name: str, optional: bool) -> dict[str, str] | None:
    data = lookup(kind, ns, name)
    if data is None and not optional:
        raise ConfigError(f'{kind} "{name}" not found')
    return data


def container_env(
    pod: dict,
    container: dict,
    lookup: Lookup,
    pod_ip: str | None,
    host_ip: str | None,
    node_allocatable: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables the pod spec gives this container, in kubelet's order (envFrom, then env)."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        if "configMapRef" in src:
            ref = src["configMapRef"]
            data = _ref_data(lookup, "configmap", ns, ref["name"], bool(ref.get("optional")))
        elif "secretRef" in src:
            ref = src["secretRef"]
            data = _ref_data(lookup, "secret", ns, ref["name"], bool(ref.get("optional")))
        else:
            raise ConfigError(f"unsupported envFrom source {sorted(src)}")
        for k, v in (data or {}).items():
            if _ENV_NAME.match(prefix + k):  # kubelet skips invalid names (with an event)
                env[prefix + k] = v
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "secretKeyRef" in vf or "configMapKeyRef" in vf:
            kind, ref = ("secret", vf["secretKeyRef"]) if "secretKeyRef" in vf else ("configmap", vf["configMapKeyRef"])
            optional = bool(ref.get("optional"))
            data = _ref_data(lookup, kind, ns, ref["name"], optional)
            if data is None:
                continue
            if ref["key"] not in data:
                if optional:
                    continue
                what = "Secret" if kind == "secret" else "ConfigMap"
                raise ConfigError(f"couldn't find key {ref['key']} in {what} {ns}/{ref['name']}")
            env[name] = data[ref["key"]]
        elif "fieldRef" in vf:
            env[name] = field_value(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in vf:
            env[name] = resource_value(container, vf["resourceFieldRef"], node_allocatable or {})
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(vf)}")
    return env


def container_argv(container: dict, env: Mapping[str, str]) -> list[str]:
    """command + args, expanded. The image is ignored here, so an image ENTRYPOINT cannot stand in."""
    command = container.get("command") or []
    if not command:
        raise ConfigError(
            f"container {container['name']!r} has no command: the node agent ignores images, "
            "so the pod must give the command to run"
        )
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]
