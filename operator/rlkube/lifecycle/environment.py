"""The environment a role process gets: written once, turned into pod env by the builders and into process env
by `rlkube local`.

The variables are the runtime contract of `rlkube.core.runtime` (what `RoleContext.from_env` reads) plus
torchrun's names for trainer ranks. What differs between launchers is only where things are, which the caller
passes as `Addresses`: in a cluster, headless-Service names and `$(POD_IP)`; locally, 127.0.0.1 ports. The Redis
password is not here: pods take it from a Secret (`secretKeyRef`), a local job's Redis has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkube.api.spec import TrainingJobSpec
from rlkube.core import runtime
from rlkube.lifecycle.roles import INFERENCE, TRAINER


@dataclass(frozen=True)
class Addresses:
    """Where a job's parts are, as the launcher lays them out."""

    config_path: str
    """The job config file (runtime.write_job_config's format)."""
    redis_url: str
    """redis://host:port/db without the password."""
    bind_host: str
    """Address servers bind to: `$(POD_IP)` in a pod (expanded by the kubelet), 127.0.0.1 locally."""
    inference_urls: tuple[str, ...]
    """Base URL of every inference server, by index."""
    inference_ports: tuple[int, ...]
    """Port each inference server listens on, by index."""
    weight_sync_host: str
    """Host of trainer rank 0, whose TCPStore hosts the weight-update group."""
    weight_sync_port: int
    master_port: int
    """torch.distributed rendezvous port of trainer rank 0 (data-parallel ranks)."""
    checkpoint_dir: str
    output_dir: str | None = None
    """Where a role may write logs/metrics (local runs)."""


def role_env(spec: TrainingJobSpec, role: str, index: int, at: Addresses) -> list[tuple[str, str]]:
    """(name, value) pairs, in order, for process `index` of `role` (trainer: its node rank)."""
    env = [
        (runtime.ENV_CONFIG, at.config_path),
        (runtime.ENV_REDIS_URL, at.redis_url),
        (runtime.ENV_BIND_HOST, at.bind_host),
        (runtime.ENV_INDEX, str(index)),
        ("PYTHONUNBUFFERED", "1"),
    ]
    if role in ("actor", TRAINER):
        env.append((runtime.ENV_INFERENCE_URLS, ",".join(at.inference_urls)))
    if role in (TRAINER, INFERENCE):
        env.append((runtime.ENV_WEIGHT_SYNC, f"{at.weight_sync_host}:{at.weight_sync_port}"))
    if role == INFERENCE:
        env.append((runtime.ENV_PORT, str(at.inference_ports[index])))
    if role == TRAINER:
        nodes = spec.trainer.nodes
        env += [
            (runtime.ENV_PORT, str(at.weight_sync_port)),
            (runtime.ENV_CHECKPOINT_DIR, at.checkpoint_dir),
            # torch.distributed env:// rendezvous, one process per node (torchrun's names).
            ("RANK", str(index)),
            ("WORLD_SIZE", str(nodes)),
            ("NODE_RANK", str(index)),
            ("NNODES", str(nodes)),
            ("LOCAL_RANK", "0"),
            ("MASTER_ADDR", at.weight_sync_host),
            ("MASTER_PORT", str(at.master_port)),
        ]
    if at.output_dir is not None:
        env.append((runtime.ENV_OUTPUT_DIR, at.output_dir))
    return env
