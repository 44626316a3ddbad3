"""Pod volumes as host directories, and the bind mounts that put them at each container's mountPath.

emptyDir, configMap, secret and downwardAPI volumes are materialised under the pod's directory (files
written once at pod start: later ConfigMap/Secret edits are not propagated, unlike kubelet);
persistentVolumeClaim volumes map to a directory per claim that outlives pods (the agent acts as the
node-local provisioner); hostPath binds the host path. Any other volume type stops the pod with a clear
message rather than running it without the volume.

Mount points that do not exist on the host (e.g. /checkpoints) are created there as empty directories (or
empty files for a file subPath): a bind mount needs a target, and the binds themselves live only in the
pod's private mount namespace. They are left in place afterwards: removing a directory that is a mount
point in another live pod's namespace would detach that pod's volume.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from nodeagent.envvars import ConfigError, Lookup, field_value, resource_value


class VolumeError(Exception):
    """The pod's volumes cannot be set up yet (kubelet: FailedMount); retried later."""


REPO = Path(__file__).resolve().parents[2]
"""The checkout: the pods' code (an editable install points here)."""


def host_paths(env: dict[str, str]) -> list[str]:
    """The host directories a pod's processes run from, in place of an image's files: the checkout, the agent's
    interpreter environment, PYTHONPATH's and PATH's entries, and RLKUBE_VLLM_PYTHON's environment. podinit binds
    back any of them a volume of the pod covers (a checkout under /tmp, where every pod mounts an emptyDir): a
    container's volumes never hide its image."""
    paths = {str(REPO), os.path.realpath(sys.prefix), sys.prefix}
    paths.update(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)
    if env.get("RLKUBE_VLLM_PYTHON"):
        paths.add(str(Path(env["RLKUBE_VLLM_PYTHON"]).parent.parent))
    paths.update(p for p in env.get("PATH", "").split(os.pathsep) if p)
    return sorted(p for p in paths if os.path.isabs(p))


ClaimDir = Callable[[str, str], Path]  # (namespace, claimName) -> directory; raises VolumeError


def _write_items(dest: Path, data: dict[str, str], items: list[dict] | None, mode: int, what: str) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    chosen = [(i["key"], i["path"], i.get("mode", mode)) for i in items] if items else [(k, k, mode) for k in data]
    for key, rel, m in chosen:
        if key not in data:
            raise VolumeError(f"{what}: key {key!r} not found")
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[key])
        os.chmod(path, m)


def prepare(pod: dict, pod_dir: Path, lookup: Lookup, claim_dir: ClaimDir, pod_ip: str | None,
            host_ip: str | None) -> dict[str, Path]:
    """volume name -> host path, creating what the pod needs. Raises VolumeError with the reason."""
    ns = pod["metadata"]["namespace"]
    out: dict[str, Path] = {}
    for vol in pod["spec"].get("volumes") or []:
        name = vol["name"]
        dest = pod_dir / "volumes" / name
        if "emptyDir" in vol:
            dest.mkdir(parents=True, exist_ok=True)
        elif "configMap" in vol or "secret" in vol:
            kind = "configmap" if "configMap" in vol else "secret"
            src = vol["configMap"] if kind == "configmap" else vol["secret"]
            ref = src.get("name") if kind == "configmap" else src.get("secretName")
            data = lookup(kind, ns, ref)
            if data is None:
                if src.get("optional"):
                    dest.mkdir(parents=True, exist_ok=True)
                    out[name] = dest
                    continue
                raise VolumeError(f'MountVolume.SetUp failed for volume "{name}": {kind} "{ref}" not found')
            _write_items(dest, data, src.get("items"), src.get("defaultMode", 0o644), f'volume "{name}"')
        elif "downwardAPI" in vol:
            spec = vol["downwardAPI"]
            data, items = {}, []
            for item in spec.get("items") or []:
                try:
                    if "fieldRef" in item:
                        data[item["path"]] = field_value(pod, item["fieldRef"]["fieldPath"], pod_ip, host_ip)
                    else:
                        cname = item["resourceFieldRef"].get("containerName")
                        ctr = next(c for c in pod["spec"]["containers"] if c["name"] == cname)
                        data[item["path"]] = resource_value(ctr, item["resourceFieldRef"], {})
                except (ConfigError, StopIteration, KeyError) as exc:
                    raise VolumeError(f'volume "{name}": {exc}') from exc
                items.append({"key": item["path"], "path": item["path"], "mode": item.get("mode", 0o644)})
            _write_items(dest, data, items, spec.get("defaultMode", 0o644), f'volume "{name}"')
        elif "persistentVolumeClaim" in vol:
            dest = claim_dir(ns, vol["persistentVolumeClaim"]["claimName"])
        elif "hostPath" in vol:
            dest = Path(vol["hostPath"]["path"])
            if vol["hostPath"].get("type") == "DirectoryOrCreate":
                dest.mkdir(parents=True, exist_ok=True)
            elif not dest.exists():
                raise VolumeError(f'volume "{name}": hostPath {dest} does not exist')
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise VolumeError(f'volume "{name}": type {kinds} is not supported by the rlkube test node agent')
        out[name] = dest
    return out


def mounts(container: dict, volumes: dict[str, Path]) -> list[dict]:
    """Bind mounts for one container; creates missing mount points on the host (see module docstring)."""
    result = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in volumes:
            raise VolumeError(f'container {container["name"]!r}: volumeMount "{vm["name"]}" has no volume')
        source = volumes[vm["name"]]
        if vm.get("subPath"):
            source = source / vm["subPath"]
            if not source.exists():
                source.mkdir(parents=True)  # kubelet creates a missing subPath as a directory
        target = Path(vm["mountPath"])
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch()
        result.append({"source": str(source), "target": str(target), "readOnly": bool(vm.get("readOnly"))})
    return result
