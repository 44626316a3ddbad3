"""Names and labels of a TrainingJob's children: the contract the node agent, the roles and the tests rely on.

One module so the builders (which stamp them), the operator (which selects by them) and the test kubelet
(which reads them) cannot disagree. Pure string functions, no Kubernetes client.
"""

from __future__ import annotations

from rlkube.api.spec import API_VERSION, KIND

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_NAME = "app.kubernetes.io/name"
LABEL_JOB = "rlkube.io/job-name"
LABEL_ROLE = "rlkube.io/role"
LABEL_INDEX = "rlkube.io/index"
MANAGED_BY = "rlkube"

ANNOTATION_ATTEMPT = "rlkube.io/attempt"
"""Replacement count of a pod slot: 0 for the first pod, +1 each time the operator replaces a failed one."""
ANNOTATION_RESUME = "rlkube.io/resume-from-checkpoint"
"""Last checkpoint the operator knew of when it (re)created a trainer pod (informational; the trainer finds
its own latest checkpoint in RLKUBE_CHECKPOINT_DIR)."""

CONFIG_MOUNT = "/etc/rlkube"
CONFIG_KEY = "job.json"
SECRET_KEY = "password"

SERVICE_ROLES = ("redis", "inference", "trainer")
"""Roles with a headless Service (and so `hostname`/`subdomain` on their pods)."""



def pod_name(job: str, role: str, index: int = 0) -> str:
    """`{job}-{role}-{index}`; the managed Redis is the single `{job}-redis`."""
    return f"{job}-redis" if role == "redis" else f"{job}-{role}-{index}"


def service_name(job: str, role: str) -> str:
    return f"{job}-{role}"


def secret_name(job: str) -> str:
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
