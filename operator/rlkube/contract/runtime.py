"""What a role process is told about its job: the contract between the launchers and the roles.

Both launchers (the operator's pod builders and `rlkube local`) start every role as
`python -m rlkube.core.<role>` with the environment variables below; the roles read them with
`RoleContext.from_env()` (rlkube.contract.context). The job config file is `{"namespace", "name", "spec"}` with the spec
in camelCase, exactly as in the TrainingJob.

Network names: in a cluster every Service is headless and each pod has `hostname`/`subdomain` set, so the
launcher passes names like `{job}-inference-0.{job}-inference:8000`; locally it passes 127.0.0.1 ports.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from rlkube.api.spec import TrainingJobSpec

ENV_CONFIG = "RLKUBE_CONFIG"  # path of the job config JSON
ENV_REDIS_URL = "RLKUBE_REDIS_URL"  # redis://host:port/db, without the password
ENV_REDIS_PASSWORD = "REDIS_PASSWORD"  # from the job's Secret (managed) or the user's (external)
ENV_INDEX = "RLKUBE_INDEX"  # replica index of this pod within its role; trainer: node rank
ENV_INFERENCE_URLS = "RLKUBE_INFERENCE_URLS"  # comma-separated base URLs of every inference server
ENV_WEIGHT_SYNC = "RLKUBE_WEIGHT_SYNC_ADDR"  # host:port of the trainer's TCPStore for the weight-update group
ENV_BIND_HOST = "RLKUBE_BIND_HOST"  # address servers bind to (the pod IP; 127.0.0.1 locally)
ENV_PORT = "RLKUBE_PORT"  # port of this role's server (inference HTTP, trainer weight-sync store)
ENV_CHECKPOINT_DIR = "RLKUBE_CHECKPOINT_DIR"  # trainer checkpoints (a volume in a cluster)
# A colocated trainer (spec.inference.placement colocated): JSON {"env": {...}, "unset": [...]} that turns the
# trainer's environment into its engine's (rlkube.core.launch.colocated starts both processes).
ENV_COLOCATED_ENGINE = "RLKUBE_COLOCATED_ENGINE"
ENV_SANDBOX_URLS = "RLKUBE_SANDBOX_URLS"  # actor: comma-separated base URLs of the job's sandbox servers
# sandbox server: its per-snippet limits (JSON of rlkube.core.actor.sandbox.SandboxLimits), set by the launcher
ENV_SANDBOX_LIMITS = "RLKUBE_SANDBOX_LIMITS"
ENV_SANDBOX_WORK = "RLKUBE_SANDBOX_WORK"  # sandbox server: where each snippet gets a fresh directory
# sandbox server: "1" = exit EXIT_CONFIG at start unless a snippet can get a network namespace of its own
ENV_SANDBOX_REQUIRE_NETNS = "RLKUBE_SANDBOX_REQUIRE_NETNS"
ENV_SANDBOX_CONCURRENCY = "RLKUBE_SANDBOX_CONCURRENCY"  # sandbox server: snippets run at once
# sandbox server: the in-process layers to use, comma-separated, of netns,audit (default both; a test turns one off
# to show the rest holds on its own)
ENV_SANDBOX_LAYERS = "RLKUBE_SANDBOX_LAYERS"
# Trainer: the checkpoint the launcher last saw saved (status.trainer.lastCheckpoint.path), unset before the first;
# a trainer that finds none as new fails (rlkube.contract.checkpoint_loss).
ENV_RESUME_CHECKPOINT = "RLKUBE_RESUME_CHECKPOINT"
ENV_OUTPUT_DIR = "RLKUBE_OUTPUT_DIR"  # logs/metrics a role may write (optional)
# Where spec.model.path is materialized (hf:// snapshots, builtin:// models); every role of a job should see the
# same directory (a shared volume) or each writes/fetches its own copy. Default ~/.cache/rlkube/models.
ENV_MODEL_CACHE = "RLKUBE_MODEL_CACHE"
# Trainer with spec.tracking.wandb.apiKeySecret: the W&B API key, from that Secret (secretKeyRef), read by the W&B
# client itself; the key is in no manifest, ConfigMap or status.
ENV_WANDB_API_KEY = "WANDB_API_KEY"
ENV_HF_OFFLINE = "HF_HUB_OFFLINE"  # huggingface_hub's switch: 1 = use the model cache only, never the network
# Trainer with spec.trainer.nodes > 1 (data parallelism), besides torchrun's RANK, WORLD_SIZE, NODE_RANK, NNODES,
# LOCAL_RANK, MASTER_ADDR, MASTER_PORT: seconds after which a rank that stopped answering (died or hung) makes the
# other ranks exit 1 without training_finished (default 120; rlkube.core.backends.torch_distributed).
ENV_COLLECTIVE_TIMEOUT = "RLKUBE_COLLECTIVE_TIMEOUT_S"

EXIT_CONFIG = 78
"""Exit code of a role whose input cannot work (sysexits' EX_CONFIG): a model directory that is missing or of an
unsupported architecture, a dataset without the mapped field. The launchers fail the job at once with the role's
termination message instead of restarting it (rlkube.lifecycle.policies.config_error)."""
TERMINATION_LOG = "/dev/termination-log"
"""Kubernetes' default terminationMessagePath: what a role writes here before a fatal exit lands in its pod's
status (and so in the job's Failed condition). `rlkube local` points ENV_TERMINATION_LOG at a file per process."""
ENV_TERMINATION_LOG = "RLKUBE_TERMINATION_LOG"

INFERENCE_PORT = 8000
SANDBOX_PORT = 8090
WEIGHT_SYNC_PORT = 29500
REDIS_PORT = 6379


def weight_sync_world_size(spec: TrainingJobSpec) -> int:
    """Ranks of the weight-update group: the trainer's rank 0, and every tensor-parallel worker of every inference
    server (each worker holds a shard of the model and loads its part from the full broadcast). The one formula:
    the trainer's publisher, both engines and `rlkube bench` use it (the launchers pass the spec, not the size)."""
    return 1 + spec.inference.replicas * spec.inference.tensor_parallel


def weight_sync_rank(spec: TrainingJobSpec, index: int, tp_rank: int = 0) -> int:
    """Rank of tensor-parallel worker `tp_rank` of inference server `index`: 1 + index x tensorParallel + tp_rank
    (a server's workers are consecutive ranks; the server passes the first, each worker adds its own TP rank)."""
    tp = spec.inference.tensor_parallel
    if not 0 <= index < spec.inference.replicas:
        raise ValueError(f"inference index {index} outside 0..{spec.inference.replicas - 1}")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tensor-parallel rank {tp_rank} outside 0..{tp - 1}")
    return 1 + index * tp + tp_rank


def with_password(url: str, password: str | None) -> str:
    """Insert a password into a redis:// URL (kept out of the URL in manifests: it comes from a Secret)."""
    if not password:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f":{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def job_config(namespace: str, name: str, spec: dict, uid: str | None = None) -> str:
    """The job config every role reads (rlkube.contract.context): the job's namespace, name, the run's `uid` (the
    TrainingJob's metadata.uid; `rlkube local` draws one per run: what tells this run's kept rows from an earlier
    job's on a reused claim, docs/design.md §5.7) and the spec as applied."""
    doc = {"namespace": namespace, "name": name, **({"uid": uid} if uid else {}), "spec": spec}
    return json.dumps(doc, indent=1)


def write_job_config(path: Path, namespace: str, name: str, spec: dict, uid: str | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_config(namespace, name, spec, uid))
    return path
