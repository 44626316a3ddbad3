"""The environment a role process gets: written once, turned into pod env by the builders and into process env
by `rlkube local`.

The variables are the runtime contract of `rlkube.contract.runtime` (what `RoleContext.from_env` reads) plus
torchrun's names for trainer ranks. Trainer ranks follow torchrun's static-rendezvous arithmetic: a trainer pod
(node) runs `processes_per_node` ranks, RANK = NODE_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK, WORLD_SIZE = nodes *
processes_per_node. With one rank per pod the pod's process is the rank (RANK/LOCAL_RANK in its env); with more,
the pod runs `rlkube.core.launch.ranks`, which starts each rank with `rank_env` (rlkube.contract.parallel) added. What
differs between launchers is only where things are, which the caller passes as `Addresses`: in a cluster,
headless-Service names and `$(POD_IP)`; locally, 127.0.0.1 ports. The Redis password is not here: pods take it from a
Secret (`secretKeyRef`), a local job's Redis has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rlkube.api.role import Role
from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import runtime
from rlkube.contract.parallel import RANK_ENV, processes_per_node, rank_env
from rlkube.lifecycle.roles import MODEL_ROLES, colocated

POD_IP = "POD_IP"
"""The pod's IP from the downward API (pods only): servers bind to it (`bind_host` is `$(POD_IP)`)."""
LAUNCHER_MODULE = "rlkube.core.launch.ranks"
COLOCATED_MODULE = "rlkube.core.launch.colocated"
"""What a colocated trainer pod (process) runs: the trainer and its engine as two child processes."""


def role_module(spec: TrainingJobSpec, role: str) -> str:
    """The module a role's pod (or local process) runs: the trainer's launcher when a pod holds several ranks.
    Fast-LLM trainer pods run Fast-LLM's own launcher instead (built apart; not decided here)."""
    if role == Role.TRAINER and processes_per_node(spec) > 1:
        return LAUNCHER_MODULE
    if role == Role.TRAINER and colocated(spec):
        return COLOCATED_MODULE
    return f"rlkube.core.{role}"


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
    model_cache_dir: str | None = None
    """Where spec.model.path is materialized (runtime.ENV_MODEL_CACHE); None: the roles' default."""
    sandbox_urls: tuple[str, ...] = ()
    """Base URL of every sandbox server (spec.sandbox.mode `pods`); empty: snippets run in the actor's process."""


def role_env(spec: TrainingJobSpec, role: str, index: int, at: Addresses,
             resume_checkpoint: str | None = None) -> list[tuple[str, str]]:
    """(name, value) pairs, in order, for process `index` of `role` (trainer: its node rank). `resume_checkpoint`:
    the trainer's last checkpoint the launcher saw saved, which it must find again (lifecycle.checkpoint_loss)."""
    env = [
        (runtime.ENV_CONFIG, at.config_path),
        (runtime.ENV_REDIS_URL, at.redis_url),
        (runtime.ENV_BIND_HOST, at.bind_host),
        (runtime.ENV_INDEX, str(index)),
        ("PYTHONUNBUFFERED", "1"),
    ]
    if role in (Role.ACTOR, Role.TRAINER):
        env.append((runtime.ENV_INFERENCE_URLS, ",".join(at.inference_urls)))
    if role == Role.ACTOR and at.sandbox_urls:
        env.append((runtime.ENV_SANDBOX_URLS, ",".join(at.sandbox_urls)))
    if role in (Role.TRAINER, Role.INFERENCE):
        env.append((runtime.ENV_WEIGHT_SYNC, f"{at.weight_sync_host}:{at.weight_sync_port}"))
    if role == Role.INFERENCE:
        env.append((runtime.ENV_PORT, str(at.inference_ports[index])))
    if role == Role.TRAINER:
        nodes, per_node = spec.trainer.nodes, processes_per_node(spec)
        env += [
            (runtime.ENV_PORT, str(at.weight_sync_port)),
            (runtime.ENV_CHECKPOINT_DIR, at.checkpoint_dir),
            # torch.distributed rendezvous at rank 0 (torchrun's names; static: every rank knows its number).
            ("WORLD_SIZE", str(nodes * per_node)),
            ("NODE_RANK", str(index)),
            ("NNODES", str(nodes)),
            ("LOCAL_WORLD_SIZE", str(per_node)),
            ("MASTER_ADDR", at.weight_sync_host),
            ("MASTER_PORT", str(at.master_port)),
        ]
        if per_node == 1:  # the pod's process is the rank; with more, the launcher adds rank_env per process
            env += rank_env(spec, index, 0)
        if resume_checkpoint is not None:
            env.append((runtime.ENV_RESUME_CHECKPOINT, resume_checkpoint))
    if at.output_dir is not None:
        env.append((runtime.ENV_OUTPUT_DIR, at.output_dir))
    if at.model_cache_dir is not None and role in MODEL_ROLES:
        env.append((runtime.ENV_MODEL_CACHE, at.model_cache_dir))
    if role == Role.TRAINER and colocated(spec):
        env.append((runtime.ENV_COLOCATED_ENGINE, colocated_engine(spec, at)))
    return env


def colocated_engine(spec: TrainingJobSpec, at: Addresses) -> str:
    """What turns a colocated trainer's environment into its engine's (runtime.ENV_COLOCATED_ENGINE): the engine's
    role env to set, and the trainer's own variables (its rank, its port) to drop. `$(POD_IP)` in a value is
    expanded by the kubelet as in any env value, so the engine binds where a separate inference pod would."""
    engine = dict(role_env(spec, Role.INFERENCE, 0, at))
    trainer = [name for name, _ in role_env(spec.model_copy(update={"inference": spec.inference.model_copy(
        update={"placement": "separate"})}), Role.TRAINER, 0, at)]
    trainer += [runtime.ENV_RESUME_CHECKPOINT, runtime.ENV_COLOCATED_ENGINE, *RANK_ENV]
    unset = sorted(set(trainer) - set(engine))
    return json.dumps({"env": engine, "unset": unset}, sort_keys=True)


def operator_env_names(spec: TrainingJobSpec, role: str) -> frozenset[str]:
    """Every variable the operator sets in a role's container: a pod template may not override these (the rank
    env, where the job's parts are, the Redis password). Derived from role_env itself, so the two cannot drift."""
    pod_only = {runtime.ENV_REDIS_PASSWORD, POD_IP}  # from the job's Secret and the downward API (builders)
    if role == Role.TRAINER and spec.tracking.wandb is not None and spec.tracking.wandb.api_key_secret is not None:
        pod_only.add(runtime.ENV_WANDB_API_KEY)  # from the user's Secret (builders)
    if role == Role.REDIS:
        return frozenset(pod_only)
    if role == Role.SANDBOX:  # no password there: the sandbox's own env (sandbox_env), its address and HOME
        return frozenset({name for name, _ in sandbox_env(spec, "", 0, "")} | {POD_IP, "HOME"})
    n = spec.inference.replicas
    at = Addresses(config_path="", redis_url="", bind_host="", inference_urls=("",) * n, inference_ports=(0,) * n,
                   weight_sync_host="", weight_sync_port=0, master_port=0, checkpoint_dir="", model_cache_dir="")
    names = {name for name, _ in role_env(spec, role, 0, at, resume_checkpoint="")} | pod_only
    if role == Role.TRAINER:
        names |= set(RANK_ENV)
    return frozenset(names)


def sandbox_env(spec: TrainingJobSpec, bind_host: str, port: int, work_dir: str) -> list[tuple[str, str]]:
    """(name, value) pairs of a sandbox server (rlkube.core.sandbox.server): where it listens, the per-snippet limits
    of spec.task.environment.sandbox, where snippets get their fresh directories. Nothing else of the job: no
    Redis address or password, no job config."""
    env = spec.task.environment
    limits = env.sandbox if env is not None else None
    doc = {} if limits is None else {
        "timeout_s": limits.timeout_seconds, "cpu_s": limits.cpu_seconds, "memory_mb": limits.memory_mib,
        "output_bytes": limits.output_bytes, "processes": limits.processes}
    return [
        (runtime.ENV_BIND_HOST, bind_host),
        (runtime.ENV_PORT, str(port)),
        (runtime.ENV_SANDBOX_LIMITS, json.dumps(doc, sort_keys=True)),
        (runtime.ENV_SANDBOX_WORK, work_dir),
        (runtime.ENV_SANDBOX_REQUIRE_NETNS, "1" if spec.sandbox.require_network_namespace else "0"),
        (runtime.ENV_SANDBOX_CONCURRENCY, str(spec.sandbox.concurrency)),
        ("PYTHONUNBUFFERED", "1"),
    ]
