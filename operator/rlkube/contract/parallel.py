"""How a job's work divides among processes: trainer ranks per pod and in all, each rank's torchrun-style
environment, and whether tensor-parallel workers can split a model's attention.

Both sides of the launcher contract need these: the operator and `rlkube local` (pod env, validation) and the
role processes (rlkube.core.launch.ranks starts the ranks, the trainer sizes its groups, the vLLM server checks its
model). So they sit in the contract layer, below both, with nothing but the spec types.
"""

from __future__ import annotations

from rlkube.api.spec import TrainingJobSpec

def processes_per_node(spec: TrainingJobSpec) -> int:
    """Trainer ranks per trainer pod: spec.trainer.processesPerNode, else one per GPU, else 1 (CPU)."""
    trainer = spec.trainer
    return trainer.processes_per_node or max(trainer.gpus_per_node, 1)


def trainer_world_size(spec: TrainingJobSpec) -> int:
    return spec.trainer.nodes * processes_per_node(spec)


def rank_env(spec: TrainingJobSpec, node_rank: int, local_rank: int) -> list[tuple[str, str]]:
    """What the launcher adds for local rank `local_rank` of trainer pod `node_rank` (torchrun's worker env)."""
    per_node = processes_per_node(spec)
    if not 0 <= local_rank < per_node:
        raise ValueError(f"local rank {local_rank} outside 0..{per_node - 1}")
    return [
        ("RANK", str(node_rank * per_node + local_rank)),
        ("LOCAL_RANK", str(local_rank)),
        ("GROUP_RANK", str(node_rank)),
    ]


RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK")
"""Names rank_env sets per process."""


def tensor_parallel_heads_error(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why `tp` workers cannot split a model's attention, as vLLM decides it (each worker takes heads/tp query heads
    and kv_heads/tp key/value heads, or one replicated key/value head when there are fewer than tp), or None."""
    if heads % tp:
        return f"its {heads} attention heads do not divide among {tp} tensor-parallel workers"
    if kv_heads % tp if kv_heads >= tp else tp % kv_heads:
        return f"its {kv_heads} key/value heads do not divide among (or evenly repeat over) {tp} workers"
    return None
