"""The roles of a job, how many processes each has, and when each may start (docs/design.md §3).

Start order: Redis; trainer and inference together (the trainer never waits for inference health, and an
inference server turns healthy only after joining the trainer's weight-update group), and the sandbox pods
(spec.sandbox.mode `pods`) at once; the preprocessor once trainer and inference exist; actors once every inference
server and every sandbox pod is healthy. A colocated engine (spec.inference.placement) is no process of its own
to the launchers: the trainer's pod (process) runs it (rlkube.core.launch.colocated), so inference has no replicas and
the actors wait for the trainer to be ready (its engine healthy). Teardown runs the other way round for producers:
actors, the sandbox pods (nothing calls them any more), preprocessor, inference (after the trainer's finished event),
trainer, Redis last.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rlkube.api.role import Role
from rlkube.api.spec import TrainingJobSpec

START_ORDER = (Role.REDIS, Role.TRAINER, Role.INFERENCE, Role.SANDBOX, Role.PREPROCESSOR, Role.ACTOR)
"""Every role, in the order a pass considers starting them (each gate sees what earlier roles got)."""
TEARDOWN_ORDER = (Role.ACTOR, Role.PREPROCESSOR, Role.INFERENCE, Role.TRAINER, Role.REDIS)
"""Stop order: producers first, inference after the trainer's finished event, Redis last (docs/design.md §4.4).
Sandbox pods stop in the actors' stage (STAGE_ROLES): only actors call them, and a job without them keeps the
same five stages."""
STAGE_ROLES = {Role.ACTOR: (Role.ACTOR, Role.SANDBOX)}
"""The roles whose pods a teardown stage stops, where more than its own."""
CORE_ROLES = (Role.TRAINER, Role.INFERENCE, Role.PREPROCESSOR, Role.ACTOR)
"""Roles that run `python -m rlkube.core.<role>` (Redis is a plain redis-server)."""
MODEL_ROLES = (Role.TRAINER, Role.INFERENCE, Role.ACTOR)
"""Roles that load the model (weights, or the tokenizer for the actor): the operator materializes spec.model.path
into their model cache before they start. The preprocessor works on token ids only."""
DATASET_ROLES = (Role.ACTOR,)
"""Roles that read spec.task.dataset (the prompts)."""


def replicas(spec: TrainingJobSpec, role: str) -> int:
    """Processes (pods) a role should have. Redis: one in managed mode, none with an external Redis."""
    if role == Role.REDIS:
        return 1 if spec.redis.mode == "managed" else 0
    if role == Role.TRAINER:
        return spec.trainer.nodes
    if role == Role.SANDBOX:
        return spec.sandbox.replicas if uses_sandbox_pods(spec) else 0
    if role == Role.INFERENCE and colocated(spec):
        return 0  # the trainer's pod runs the engine
    return spec.section(role).replicas


def colocated(spec: TrainingJobSpec) -> bool:
    """The native engine runs in the trainer's pod (process group) on its devices: spec.inference.placement."""
    return spec.inference.placement == "colocated"


def uses_sandbox_pods(spec: TrainingJobSpec) -> bool:
    """Snippets run in sandbox pods: spec.sandbox.mode `pods` with an environment to call them (validation refuses
    pods without one)."""
    return spec.sandbox.mode == "pods" and spec.task.environment is not None


@dataclass(frozen=True)
class StartState:
    """What a launcher knows when it decides which roles to start."""

    exist: Mapping[str, int] = field(default_factory=dict)
    """Processes (pods) of each role that exist, counting those started earlier in the same pass."""
    ready: Mapping[str, int] = field(default_factory=dict)
    """Processes (pods) of each role that are ready (Redis answers, inference /health is 200)."""


def may_start(spec: TrainingJobSpec, role: str, state: StartState) -> bool:
    """Whether `role` may be started now (only consulted while the job is starting up)."""

    def all_ready(r: str) -> bool:
        return state.ready.get(r, 0) >= replicas(spec, r)

    def all_exist(r: str) -> bool:
        return state.exist.get(r, 0) >= replicas(spec, r)

    gates: dict[str, Callable[[], bool]] = {
        Role.REDIS: lambda: True,
        Role.TRAINER: lambda: all_ready(Role.REDIS),
        Role.INFERENCE: lambda: all_ready(Role.REDIS),
        Role.PREPROCESSOR: lambda: all_ready(Role.REDIS) and all_exist(Role.TRAINER) and all_exist(Role.INFERENCE),
        Role.SANDBOX: lambda: True,
        # Colocated: the trainer is ready once its engine is healthy (a readiness probe; locally, /health).
        Role.ACTOR: lambda: (all_ready(Role.INFERENCE) and all_ready(Role.SANDBOX)
                             and (not colocated(spec) or all_ready(Role.TRAINER))),
    }
    return gates[role]()
