"""What of a role's pod the operator owns: its label keys, volumes and mount paths.

Both the pod builders (rlkube.controller.manifests.builders, through rlkube.controller.manifests.names, which
re-exports these) and the spec validation (rlkube.lifecycle.validation, which refuses a pod template that takes one of them) need the
same rules; they live here, below both, so validation does not reach up into the controller. Pure string rules.
"""

from __future__ import annotations

from rlkube.api.role import Role
from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.roles import DATASET_ROLES, MODEL_ROLES

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
MANAGED_BY = "rlkube"
OWNED_PREFIX = "rlkube.io/"
"""Labels and annotations under this prefix (and the two app.kubernetes.io ones above) are the operator's."""

CONFIG_MOUNT = "/etc/rlkube"
VOLUME_CONFIG = "job-config"  # the job's ConfigMap at CONFIG_MOUNT
VOLUME_CHECKPOINTS = "checkpoints"  # trainer: spec.trainer.checkpoint (PVC or emptyDir) at its path
VOLUME_TMP = "tmp"  # emptyDir at /tmp (and HOME): the writable place of a read-only root filesystem
VOLUME_SHM = "dshm"  # memory-backed emptyDir at /dev/shm (NCCL, torch and vLLM shared memory)
VOLUME_MODEL_CACHE = "model-cache"  # where spec.model.path is materialized (spec.model.cacheClaimName or emptyDir)
VOLUME_MODEL = "model"  # spec.model.claimName, read-only at spec.model.mountPath
VOLUME_DATASET = "dataset"  # spec.task.dataset.claimName, read-only at spec.task.dataset.mountPath
TMP_MOUNT = "/tmp"
SHM_MOUNT = "/dev/shm"
MODEL_CACHE_MOUNT = "/var/cache/rlkube/models"
"""The model cache in every pod that loads the model (runtime.ENV_MODEL_CACHE points there)."""
SANDBOX_TMP = "the snippets' directories, sized by spec.sandbox.resources.limits.ephemeral-storage"
"""Why a sandbox pod's /tmp is the operator's: a snippet's writes are bounded by its size limit."""


def role_volumes(role: str, spec: TrainingJobSpec) -> tuple[str, ...]:
    """The volumes the builders give a role's pods."""
    if role == Role.REDIS:
        return ()
    if role == Role.SANDBOX:
        return (VOLUME_TMP,)
    extra = {Role.TRAINER: (VOLUME_CHECKPOINTS, VOLUME_SHM), Role.INFERENCE: (VOLUME_SHM,)}.get(role, ())
    return (VOLUME_CONFIG, VOLUME_TMP, *extra, *data_volumes(role, spec))


def data_volumes(role: str, spec: TrainingJobSpec) -> tuple[str, ...]:
    """The model cache, model and dataset volumes of a role's pods (each only where the role reads it)."""
    out: list[str] = []
    if role in MODEL_ROLES:
        out.append(VOLUME_MODEL_CACHE)
        if spec.model.claim_name:
            out.append(VOLUME_MODEL)
    if role in DATASET_ROLES and spec.task.dataset is not None and spec.task.dataset.claim_name:
        out.append(VOLUME_DATASET)
    return tuple(out)


def owned_volumes(role: str, spec: TrainingJobSpec) -> dict[str, str]:
    """Volumes a pod template may not replace (name -> where they come from); tmp and dshm it may."""
    if role == Role.REDIS:
        return {}
    if role == Role.SANDBOX:
        return {VOLUME_TMP: SANDBOX_TMP}
    owned = {VOLUME_CONFIG: "the job config"}
    if role == Role.TRAINER:
        owned[VOLUME_CHECKPOINTS] = "use spec.trainer.checkpoint.claimName"
    if role in MODEL_ROLES:
        owned[VOLUME_MODEL_CACHE] = "use spec.model.cacheClaimName"
        owned[VOLUME_MODEL] = "use spec.model.claimName"
    if role in DATASET_ROLES:
        owned[VOLUME_DATASET] = "use spec.task.dataset.claimName"
    return owned


def owned_mounts(role: str, spec: TrainingJobSpec) -> dict[str, str]:
    """Mount paths a pod template may not take (path -> why)."""
    if role == Role.REDIS:
        return {}
    if role == Role.SANDBOX:
        return {TMP_MOUNT: SANDBOX_TMP}
    owned = {CONFIG_MOUNT: "the job config"}
    if role == Role.TRAINER:
        owned[spec.trainer.checkpoint.path.rstrip("/")] = "spec.trainer.checkpoint.path"
    if role in MODEL_ROLES:
        owned[MODEL_CACHE_MOUNT] = "the model cache"
        if spec.model.claim_name:
            owned[spec.model.mount_path.rstrip("/")] = "spec.model.mountPath"
    ds = spec.task.dataset
    if role in DATASET_ROLES and ds is not None and ds.claim_name:
        owned[ds.mount_path.rstrip("/")] = "spec.task.dataset.mountPath"
    return owned
