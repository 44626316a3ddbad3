"""The checks of a TrainingJob's pods that the CRD schema cannot express but the Pod schema or the operator
refuses: resource quantities, images, Secret names, mount paths, and what a pod template may not change.

Caught here, a job fails naming its own field and creates nothing, instead of failing at its first pod. Apart
from rlkube.lifecycle.validation (which runs them with the other checks) because they follow the Pod schema and
the operator's owned pod fields (rlkube.lifecycle.owned), not the training spec.
"""

from __future__ import annotations

import re
from decimal import Decimal

from rlkube.api.pod_template import PodTemplate
from rlkube.api.role import Role
from rlkube.api.spec import GPU, TrainingJobSpec
from rlkube.lifecycle import owned
from rlkube.lifecycle.environment import operator_env_names
from rlkube.lifecycle.field_errors import FieldError
from rlkube.lifecycle.image_reference import reference_error
from rlkube.lifecycle.label_syntax import annotation_errors, label_errors

_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def parse_quantity(value: int | str) -> Decimal:
    """A Kubernetes resource quantity (`500m`, `2Gi`, `1e3`, `4`) by the API server's grammar; ValueError else."""
    if isinstance(value, int):
        return Decimal(value)
    m = _QUANTITY.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not a quantity (e.g. 500m, 2, 1Gi)")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:])) if suffix else number


def resource_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """What the Pod schema checks in a container's resources, so it fails here and not at pod creation."""
    errs: list[FieldError] = []
    for role in (Role.TRAINER, Role.INFERENCE, Role.PREPROCESSOR, Role.ACTOR, Role.SANDBOX):
        res = spec.section(role).resources
        parsed: dict[str, dict[str, Decimal]] = {"requests": {}, "limits": {}}
        for kind in ("requests", "limits"):
            for name, value in getattr(res, kind).items():
                where = f"spec.{role}.resources.{kind}.{name}"
                if name not in _CONTAINER_RESOURCES and not name.startswith("hugepages-") and "/" not in name:
                    errs.append(
                        FieldError(where, f"unknown resource {name!r}: cpu, memory, ephemeral-storage, hugepages-*, "
                                          "or a fully qualified extended resource (example.com/gpu)")
                    )
                    continue
                try:
                    quantity = parse_quantity(value)
                except ValueError as exc:
                    errs.append(FieldError(where, str(exc)))
                    continue
                if quantity < 0:
                    errs.append(FieldError(where, "must not be negative"))
                    continue
                if "/" in name and quantity != quantity.to_integral_value():
                    errs.append(FieldError(where, "an extended resource is counted in whole units"))
                    continue
                parsed[kind][name] = quantity
        if gpus := spec.gpus_per_pod(role):
            # builders._resources replaces the GPU count written in resources with the one it derives
            parsed["limits"][GPU] = Decimal(gpus)
            if GPU in parsed["requests"]:
                parsed["requests"][GPU] = Decimal(gpus)
        names = set(parsed["requests"]) | set(parsed["limits"])
        if any(n.startswith("hugepages-") for n in names) and not names & {"cpu", "memory"}:
            errs.append(FieldError(f"spec.{role}.resources", "hugepages need a cpu or memory request or limit too"))
        for name, request in parsed["requests"].items():
            limit = parsed["limits"].get(name)
            if "/" in name and limit != request:  # extended resources are not overcommitted
                errs.append(FieldError(f"spec.{role}.resources.requests.{name}", "an extended resource needs a limit "
                                       "equal to its request"))
            elif limit is not None and request > limit:
                errs.append(FieldError(f"spec.{role}.resources.requests.{name}", f"must not exceed the limit {limit}"))
    return errs


_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def pod_field_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """Values the CRD schema lets through that the Pod schema refuses (found by the generated-input tests): caught
    here, the job fails naming its own field and creates nothing, instead of failing on its first trainer pod."""
    errs = []
    for where, image in [("spec.image", spec.image), ("spec.redis.image", spec.redis.image),
                         *((f"spec.{r}.image", spec.section(r).image)
                           for r in (Role.TRAINER, Role.INFERENCE, Role.ACTOR, Role.PREPROCESSOR))]:
        if image is not None and (problem := reference_error(image)) is not None:
            errs.append(FieldError(where, problem))
    secret = spec.redis.password_secret
    if secret is not None and spec.redis.mode == "external":  # (managed mode ignores it)
        if len(secret.name) > 253 or not _DNS1123_SUBDOMAIN.match(secret.name):
            errs.append(FieldError("spec.redis.passwordSecret.name", f"{secret.name[:80]!r} is not a Secret name "
                                   "(lower case letters, digits, '-' and '.', at most 253 characters)"))
        if len(secret.key) > 253 or not _SECRET_KEY.match(secret.key) or secret.key in (".", ".."):
            errs.append(FieldError("spec.redis.passwordSecret.key", f"{secret.key[:80]!r} is not a Secret key "
                                   "(letters, digits, '-', '_' and '.')"))
    path = spec.trainer.checkpoint.path
    taken = {owned.CONFIG_MOUNT: "the job's config", owned.TMP_MOUNT: "the pod's /tmp",
             owned.SHM_MOUNT: "shared memory", owned.MODEL_CACHE_MOUNT: "the model cache"}
    if not path.startswith("/"):
        errs.append(FieldError("spec.trainer.checkpoint.path", f"{path!r} must be an absolute path"))
    elif path.rstrip("/") in taken:
        errs.append(FieldError("spec.trainer.checkpoint.path", f"{path.rstrip('/')} holds {taken[path.rstrip('/')]}"))
    else:
        taken[path.rstrip("/")] = "spec.trainer.checkpoint.path"
    # The read-only data mounts: none may take a path the pods already use (or the other's).
    mounts = []
    if spec.model.claim_name:
        mounts.append(("spec.model.mountPath", spec.model.mount_path))
    if spec.task.dataset is not None and spec.task.dataset.claim_name:
        mounts.append(("spec.task.dataset.mountPath", spec.task.dataset.mount_path))
    for where, mount in mounts:
        mount = mount.rstrip("/") or "/"
        if mount == "/":
            errs.append(FieldError(where, "must not be / (the pod's root filesystem)"))
        elif mount in taken:
            errs.append(FieldError(where, f"{mount} holds {taken[mount]}"))
        taken[mount] = where
    return errs


TEMPLATE_ROLES = (Role.TRAINER, Role.INFERENCE, Role.ACTOR, Role.PREPROCESSOR, Role.REDIS, Role.SANDBOX)
"""The roles whose pods a spec.<role>.template may change."""


def _owned_label(key: str) -> bool:
    return key.startswith(owned.OWNED_PREFIX) or key in (owned.LABEL_MANAGED_BY, owned.LABEL_NAME)


def _syntax_errors(at: str, tpl: PodTemplate) -> list[FieldError]:
    """Labels, annotations and nodeSelector entries the API server would refuse in the role's Pod (label_syntax)."""
    errs = [FieldError(f"{at}.metadata.labels[{key}]", why) for key, why in label_errors(tpl.metadata.labels)]
    errs += [FieldError(f"{at}.metadata.annotations" + (f"[{key}]" if key is not None else ""), why)
             for key, why in annotation_errors(tpl.metadata.annotations)]
    errs += [FieldError(f"{at}.spec.nodeSelector[{key}]", why) for key, why in label_errors(tpl.spec.node_selector)]
    return errs


def template_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """What a pod template may not change: the operator's labels, env, volumes and mounts, named by field
    (`spec.trainer.template.spec.containers[trainer].env[RANK]`). Fields the operator sets outright (command,
    image, restartPolicy, ...) are refused while parsing (api/pod_template.py, _refuse_owned)."""
    errs: list[FieldError] = []
    for role in TEMPLATE_ROLES:
        tpl = spec.template_for(role)
        if tpl is None:
            continue
        at = f"spec.{role}.template"
        if role == Role.REDIS and spec.redis.mode != "managed":
            errs.append(FieldError(at, "only a managed Redis has pods (spec.redis.mode is external)"))
            continue
        for kind in ("labels", "annotations"):
            for key in getattr(tpl.metadata, kind):
                if _owned_label(key):
                    errs.append(FieldError(f"{at}.metadata.{kind}[{key}]", "set by the operator (its own keys: "
                                           f"{owned.OWNED_PREFIX}*, {owned.LABEL_MANAGED_BY}, {owned.LABEL_NAME})"))
        errs += _syntax_errors(at, tpl)
        pod = tpl.spec
        owned_volumes = owned.owned_volumes(role, spec)
        volumes = {v.name for v in pod.volumes} | set(owned.role_volumes(role, spec))
        seen: set[str] = set()
        for v in pod.volumes:
            where = f"{at}.spec.volumes[{v.name}]"
            if v.name in seen:
                errs.append(FieldError(where, "listed twice"))
            seen.add(v.name)
            if v.name in owned_volumes:
                errs.append(FieldError(where, f"set by the operator ({owned_volumes[v.name]})"))
            if len(v.model_extra or {}) != 1:
                errs.append(FieldError(where, "needs exactly one volume source (emptyDir, configMap, "
                                              "persistentVolumeClaim, ...)"))
        containers = [c.name for c in pod.containers]
        for name in containers:
            if name != role:
                errs.append(FieldError(f"{at}.spec.containers[{name}]",
                                       f"only the role's container {role!r} can be overridden (no sidecars)"))
        if len(containers) != len(set(containers)):
            errs.append(FieldError(f"{at}.spec.containers[{role}]", "listed twice"))
        owned_env = operator_env_names(spec, role)
        owned_mounts = owned.owned_mounts(role, spec)
        for c in pod.containers:
            if c.name != role:
                continue
            cat = f"{at}.spec.containers[{c.name}]"
            names_seen: set[str] = set()
            for e in c.env:
                if e.name in owned_env:
                    errs.append(FieldError(f"{cat}.env[{e.name}]", "set by the operator"))
                if e.name in names_seen:
                    errs.append(FieldError(f"{cat}.env[{e.name}]", "listed twice"))
                names_seen.add(e.name)
                if (e.value is None) == (e.value_from is None):
                    errs.append(FieldError(f"{cat}.env[{e.name}]", "needs exactly one of value and valueFrom"))
            paths: set[str] = set()
            for m in c.volume_mounts:
                where = f"{cat}.volumeMounts[{m.mount_path}]"
                if m.mount_path.rstrip("/") in owned_mounts:
                    errs.append(FieldError(where, f"set by the operator ({owned_mounts[m.mount_path.rstrip('/')]})"))
                if m.mount_path in paths:
                    errs.append(FieldError(where, "listed twice"))
                paths.add(m.mount_path)
                if m.name not in volumes:
                    errs.append(FieldError(f"{where}.name", f"no volume {m.name!r} in the pod (add it to "
                                                            f"{at}.spec.volumes)"))
    return errs
