"""Names and labels of a TrainingJob's children: the contract the node agent, the roles and the tests rely on.

One module so the builders (which stamp them), the operator (which selects by them) and the test kubelet
(which reads them) cannot disagree. Pure string functions, no Kubernetes client.
"""

from __future__ import annotations

import re

from rlkube.api.spec import API_VERSION, KIND, TrainingJobSpec
from rlkube.lifecycle.roles import DATASET_ROLES, MODEL_ROLES

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_JOB = "rlkube.io/job-name"
LABEL_ROLE = "rlkube.io/role"
LABEL_INDEX = "rlkube.io/index"
MANAGED_BY = "rlkube"
OWNED_PREFIX = "rlkube.io/"
"""Labels and annotations under this prefix (and the two app.kubernetes.io ones above) are the operator's."""

ANNOTATION_ATTEMPT = "rlkube.io/attempt"
"""Replacement count of a pod slot: 0 for the first pod, +1 each time the operator replaces a failed one."""
ANNOTATION_RESUME = "rlkube.io/resume-from-checkpoint"
"""Last checkpoint the operator knew of when it (re)created a trainer pod (informational; the trainer finds
its own latest checkpoint in RLKUBE_CHECKPOINT_DIR)."""

CONFIG_MOUNT = "/etc/rlkube"
CONFIG_KEY = "job.json"
SECRET_KEY = "password"

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
INIT_MODEL = "model"
"""The init container that materializes spec.model.path into the model cache before the role starts."""

SERVICE_ROLES = ("redis", "inference", "trainer")
"""Roles with a headless Service (and so `hostname`/`subdomain` on their pods)."""



_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_MAX = 63


def job_name_error(job: str, spec: TrainingJobSpec) -> str | None:
    """Why the children of a job of this name cannot exist, or None. A TrainingJob name may be any DNS subdomain
    (dots, a leading digit, 253 characters), but its Services `{job}-{role}` must be DNS-1035 labels and the pods
    of those roles carry `{job}-{role}-{index}` as hostname (a label, too), all at most 63 characters; the API
    server would refuse them one by one after the first children exist (a generated-input test found it)."""
    longest = max((pod_name(job, "inference", spec.inference.replicas - 1), pod_name(job, "trainer", spec.trainer.nodes - 1),
                   service_name(job, "inference")), key=len)
    if not _DNS1035_LABEL.match(job):
        return (f"metadata.name: {job!r} must be a DNS-1035 label (lower case letters, digits and '-', starting with a "
                f"letter): it names the job's Services")
    if len(longest) > LABEL_MAX:
        return (f"metadata.name: {job!r} is too long: its child {longest!r} has {len(longest)} characters, at most "
                f"{LABEL_MAX} are allowed")
    return None


def role_volumes(role: str, spec: TrainingJobSpec) -> tuple[str, ...]:
    """The volumes the builders give a role's pods."""
    if role == "redis":
        return ()
    extra = {"trainer": (VOLUME_CHECKPOINTS, VOLUME_SHM), "inference": (VOLUME_SHM,)}.get(role, ())
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
    if role == "redis":
        return {}
    owned = {VOLUME_CONFIG: "the job config"}
    if role == "trainer":
        owned[VOLUME_CHECKPOINTS] = "use spec.trainer.checkpoint.claimName"
    if role in MODEL_ROLES:
        owned[VOLUME_MODEL_CACHE] = "use spec.model.cacheClaimName"
        owned[VOLUME_MODEL] = "use spec.model.claimName"
    if role in DATASET_ROLES:
        owned[VOLUME_DATASET] = "use spec.task.dataset.claimName"
    return owned


def owned_mounts(role: str, spec: TrainingJobSpec) -> dict[str, str]:
    """Mount paths a pod template may not take (path -> why)."""
    if role == "redis":
        return {}
    owned = {CONFIG_MOUNT: "the job config"}
    if role == "trainer":
        owned[spec.trainer.checkpoint.path.rstrip("/")] = "spec.trainer.checkpoint.path"
    if role in MODEL_ROLES:
        owned[MODEL_CACHE_MOUNT] = "the model cache"
        if spec.model.claim_name:
            owned[spec.model.mount_path.rstrip("/")] = "spec.model.mountPath"
    ds = spec.task.dataset
    if role in DATASET_ROLES and ds is not None and ds.claim_name:
        owned[ds.mount_path.rstrip("/")] = "spec.task.dataset.mountPath"
    return owned


def pod_name(job: str, role: str, index: int = 0) -> str:
    """`{job}-{role}-{index}`; the managed Redis is the single `{job}-redis`."""
    return f"{job}-redis" if role == "redis" else f"{job}-{role}-{index}"


def service_name(job: str, role: str) -> str:
    return f"{job}-{role}"


def secret_name(job: str) -> str:
    return f"{job}-redis"


def network_policy_name(job: str) -> str:
    return f"{job}-redis"


def config_name(job: str) -> str:
    return f"{job}-config"


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: MANAGED_BY, LABEL_JOB: job}


def role_labels(job: str, role: str) -> dict[str, str]:
    return {**job_labels(job), LABEL_ROLE: role}


def pod_labels(job: str, role: str, index: int) -> dict[str, str]:
    return {**role_labels(job, role), LABEL_INDEX: str(index)}


def role_selector(job: str, role: str) -> dict[str, str]:
    """What a Service selects: the job and the role (not the managed-by label, which is not identity)."""
    return {LABEL_JOB: job, LABEL_ROLE: role}


def label_selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def owner_reference(job: str, uid: str) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def inference_urls(job: str, replicas: int, port: int) -> list[str]:
    return [f"http://{pod_name(job, 'inference', i)}.{service_name(job, 'inference')}:{port}" for i in range(replicas)]


def trainer_host(job: str, rank: int = 0) -> str:
    """Stable DNS name of a trainer pod through the headless trainer Service."""
    return f"{pod_name(job, 'trainer', rank)}.{service_name(job, 'trainer')}"
