"""Names and labels of a TrainingJob's children: the contract the node agent, the roles and the tests rely on.

One module so the builders (which stamp them), the operator (which selects by them) and the test kubelet
(which reads them) cannot disagree. Pure string functions, no Kubernetes client.
"""

from __future__ import annotations

import re

from rlkube.api.role import Role
from rlkube.api.spec import API_VERSION, KIND, TrainingJobSpec
from rlkube.lifecycle.owned import (  # re-exported: the builders and the operator name them from here
    CONFIG_MOUNT,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    MANAGED_BY,
    MODEL_CACHE_MOUNT,
    OWNED_PREFIX,
    SHM_MOUNT,
    TMP_MOUNT,
    VOLUME_CHECKPOINTS,
    VOLUME_CONFIG,
    VOLUME_DATASET,
    VOLUME_MODEL,
    VOLUME_MODEL_CACHE,
    VOLUME_SHM,
    VOLUME_TMP,
    data_volumes,
    owned_mounts,
    owned_volumes,
    role_volumes,
)

LABEL_JOB = "rlkube.io/job-name"
LABEL_ROLE = "rlkube.io/role"
LABEL_INDEX = "rlkube.io/index"
ANNOTATION_ATTEMPT = "rlkube.io/attempt"
"""Replacement count of a pod slot: 0 for the first pod, +1 each time the operator replaces a failed one."""
ANNOTATION_RESUME = "rlkube.io/resume-from-checkpoint"
"""Last checkpoint the operator knew of when it (re)created a trainer pod (informational; the trainer finds
its own latest checkpoint in RLKUBE_CHECKPOINT_DIR)."""

CONFIG_KEY = "job.json"
SECRET_KEY = "password"

INIT_MODEL = "model"
"""The init container that materializes spec.model.path into the model cache before the role starts."""

SERVICE_ROLES = (Role.REDIS, Role.INFERENCE, Role.TRAINER, Role.SANDBOX)
"""Roles with a headless Service (and so `hostname`/`subdomain` on their pods)."""



_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_MAX = 63


def job_name_error(job: str, spec: TrainingJobSpec) -> str | None:
    """Why the children of a job of this name cannot exist, or None. A TrainingJob name may be any DNS subdomain
    (dots, a leading digit, 253 characters), but its Services `{job}-{role}` must be DNS-1035 labels and the pods
    of those roles carry `{job}-{role}-{index}` as hostname (a label, too), all at most 63 characters; the API
    server would refuse them one by one after the first children exist (a generated-input test found it)."""
    longest = max((pod_name(job, Role.INFERENCE, spec.inference.replicas - 1),
                   pod_name(job, Role.TRAINER, spec.trainer.nodes - 1),
                   service_name(job, Role.INFERENCE)), key=len)
    if not _DNS1035_LABEL.match(job):
        return (f"metadata.name: {job!r} must be a DNS-1035 label (lower case letters, digits and '-', starting with a "
                f"letter): it names the job's Services")
    if len(longest) > LABEL_MAX:
        return (f"metadata.name: {job!r} is too long: its child {longest!r} has {len(longest)} characters, at most "
                f"{LABEL_MAX} are allowed")
    return None


def pod_name(job: str, role: str, index: int = 0) -> str:
    """`{job}-{role}-{index}`; the managed Redis is the single `{job}-redis`."""
    return f"{job}-redis" if role == Role.REDIS else f"{job}-{role}-{index}"


def service_name(job: str, role: str) -> str:
    return f"{job}-{role}"


def secret_name(job: str) -> str:
    return f"{job}-redis"


def network_policy_name(job: str) -> str:
    return f"{job}-redis"


def sandbox_network_policy_name(job: str) -> str:
    return f"{job}-sandbox"


def sandbox_urls(job: str, replicas: int, port: int) -> list[str]:
    return [f"http://{pod_name(job, Role.SANDBOX, i)}.{service_name(job, Role.SANDBOX)}:{port}"
            for i in range(replicas)]


def config_name(job: str) -> str:
    return f"{job}-config"


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_NAME: MANAGED_BY, LABEL_JOB: job}


def role_labels(job: str, role: str) -> dict[str, str]:
    return {**job_labels(job), LABEL_ROLE: str(role)}


def pod_labels(job: str, role: str, index: int) -> dict[str, str]:
    return {**role_labels(job, role), LABEL_INDEX: str(index)}


def role_selector(job: str, role: str) -> dict[str, str]:
    """What a Service selects: the job and the role (not the managed-by label, which is not identity)."""
    return {LABEL_JOB: job, LABEL_ROLE: str(role)}


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
    return [f"http://{pod_name(job, Role.INFERENCE, i)}.{service_name(job, Role.INFERENCE)}:{port}"
            for i in range(replicas)]


def trainer_host(job: str, rank: int = 0) -> str:
    """Stable DNS name of a trainer pod through the headless trainer Service."""
    return f"{pod_name(job, Role.TRAINER, rank)}.{service_name(job, Role.TRAINER)}"
