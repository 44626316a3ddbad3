"""The TrainingJob status: what the operator records, and the schema the CRD publishes for it.

The status is typed like the spec (its schema is generated from these classes) so that nothing the
operator writes is pruned by the API server and printer columns read fields that are really there.

The phases and condition types are defined here, once, as enums of the API (this package imports nothing else of
rlkube): the lifecycle, the decisions and the metrics use these members rather than their own spellings, so a value
`kubectl wait`, dashboards and alerts match on cannot drift between them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import Field

from rlkube.api.base import Model


class Phase(StrEnum):
    """The phase of a TrainingJob: Pending -> Starting -> Running -> Draining -> Succeeded | Failed (and Suspended).

    Defined here once, with the status that carries it: the decisions, the lifecycle, the metrics and the CRD
    schema (status.phase's enum) all read these members, so a phase cannot be spelled two ways.
    """

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    DRAINING = "Draining"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"

    TERMINAL: ClassVar[frozenset[Phase]]
    """The outcomes: a job in one of them is finished and never changes phase again."""


Phase.TERMINAL = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    """The metav1.Condition types the operator writes (`kubectl wait --for=condition=...` matches on them).

    Succeeded and Failed record the decided outcome: their values are the terminal phases' (`ConditionType(phase)`).
    """

    REDIS_READY = "RedisReady"
    TRAINER_READY = "TrainerReady"
    INFERENCE_READY = "InferenceReady"
    PREPROCESSOR_READY = "PreprocessorReady"
    ACTORS_READY = "ActorsReady"
    SANDBOX_READY = "SandboxReady"
    EVENT_SOURCE_REACHABLE = "EventSourceReachable"
    STALLED = "Stalled"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    RESOURCES_RELEASED = "ResourcesReleased"
    SUSPENDED = "Suspended"
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    TRACKER_FAILED = "TrackerFailed"


class ConditionStatus(StrEnum):
    """A metav1.Condition's status."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(Model):
    """A metav1.Condition."""

    type: str = Field(..., description="Condition type, e.g. TrainerReady, Succeeded, ResourcesReleased.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="True, False or Unknown.")
    reason: str = Field(..., description="CamelCase reason for the last transition.")
    message: str = Field("", description="Human-readable detail.")
    last_transition_time: str = Field(..., description="RFC 3339 time the status last changed.")
    observed_generation: int = Field(0, description="The spec generation this condition was computed from.")


class ComponentStatus(Model):
    desired: int = Field(0, description="Pods this role should have.")
    ready: int = Field(0, description="Pods of this role that are Ready.")
    restarts: int = Field(0, description="Times pods of this role were recreated or restarted.")
    restarts_of_replaced_pods: int = Field(
        0, description="Restarts carried over from pods the operator replaced (their restartCount plus the replacement)."
    )
    replaced_pods: list[str] = Field(
        default_factory=list, description="UIDs of the most recent failed pods already replaced (counted once)."
    )
    pull_failing_since: dict[str, str] = Field(
        default_factory=dict, description="Pods of this role whose image the kubelet fails to pull, by UID: when the "
        "operator first saw the failure (RFC 3339); runPolicy.imagePullTimeoutSeconds counts from it."
    )


class CheckpointRef(Model):
    step: int = Field(..., description="Step of the checkpoint.")
    path: str = Field(..., description="Path of the checkpoint inside the trainer's checkpoint volume.")


class TrainerStatus(Model):
    step: int = Field(0, description="Last optimizer step the trainer reported.")
    max_steps: int = Field(0, description="spec.algorithm.maxSteps.")
    weights_version: int = Field(0, description="Last weight version the trainer published.")
    last_checkpoint: CheckpointRef | None = Field(None, description="Last checkpoint the trainer saved.")
    last_event_id: str | None = Field(None, description="Redis stream id of the last trainer event read.")
    last_event_time: str | None = Field(None, description="When the last trainer event was read (RFC 3339).")
    documents_seen: int = Field(0, description="Training documents consumed, as last reported.")
    reward_mean: float | None = Field(
        None, description="Mean reward of the training documents of the last step the trainer reported (4 decimals)."
    )
    tokens_per_second: float | None = Field(
        None, description="Tokens trained per second of wall time in the last step the trainer reported."
    )
    eval_reward_mean: float | None = Field(
        None, description="Mean reward over the held-out eval set at evalVersion (spec.evaluation; 4 decimals)."
    )
    eval_version: int | None = Field(None, description="Weight version of the last evaluation reported.")
    eval_prompts: int | None = Field(None, description="Eval prompts scored in the last evaluation reported.")
    eval_skipped: int | None = Field(
        None, description="Eval prompts the last evaluation could not score (the environment or the server failed)."
    )
    eval_reward_errors: int | None = Field(
        None, description="Eval samples of the last evaluation whose reward function failed (scored 0)."
    )


class AgentStatus(Model):
    """The multi-turn episode counters as the trainer last reported them (spec.task.environment): whole-job totals
    and the last reported mean per-turn reward. The names and types are rlkube.contract.counters' (this package
    imports nothing else of rlkube; tests/unit/test_agent_counters.py holds the two together)."""

    episodes: int = Field(0, description="Episodes written to the rollouts.")
    turns: int = Field(0, description="The model's replies.")
    tool_calls: int = Field(0, description="Environment answers (each respond that returned messages).")
    tool_errors: int = Field(0, description="Episodes ended by the environment's code raising.")
    tool_timeouts: int = Field(0, description="Episodes ended by an answer past toolTimeoutSeconds.")
    sandbox_refusals: int = Field(0, description="Snippets the sandbox refused.")
    truncated: int = Field(0, description="Episodes cut by maxTurns or maxEpisodeTokens.")
    timed_out: int = Field(0, description="Episodes cut by episodeTimeoutSeconds.")
    drifted: int = Field(0, description="Episodes whose conversation re-renders to other token ids than sampled.")
    turn_reward_mean: float | None = Field(
        None, description="Mean per-turn reward over the turns rewarded in the last step that had any (4 decimals)."
    )


class Completion(Model):
    """The evidence that decided the outcome."""

    stream_id: str | None = Field(None, description="Stream id of the training_finished event.")
    event_time: str | None = Field(None, description="When the training_finished event was read.")
    final_step: int | None = Field(None, description="Step reported by training_finished.")
    checkpoint: str | None = Field(None, description="Checkpoint reported by training_finished.")
    interrupted: bool | None = Field(
        None, description="training_finished came from a scheduled or interrupted stop (or below maxSteps)."
    )
    trainer_exit_code: int | None = Field(None, description="Exit code of the trainer container.")
    trainer_exit_time: str | None = Field(None, description="When the trainer exit was observed.")


class TeardownStage(Model):
    name: str = Field(..., description="Role stopped in this stage.")
    started_at: str | None = Field(None, description="When the stage began deleting pods.")
    finished_at: str | None = Field(None, description="When the stage's pods were all gone.")
    forced: int = Field(0, description="Pods force-deleted after the grace period.")


class TeardownStatus(Model):
    reason: str | None = Field(None, description="Why teardown runs: Succeeded, Failed, Deleted or Suspended.")
    stage: str | None = Field(None, description="Current stage (role name), or Done.")
    stages: list[TeardownStage] = Field(default_factory=list, description="Stages started so far, in order.")


class TrainingJobStatus(Model):
    """Observed state of a TrainingJob, written by the rlkube operator only."""

    phase: Phase = Field(Phase.PENDING, description="Pending, Starting, Running, Draining, Succeeded, Failed, Suspended.")
    reason: str | None = Field(None, description="Reason of the current phase (CamelCase).")
    message: str | None = Field(None, description="Human-readable detail of the current phase.")
    observed_generation: int = Field(0, description="Last spec generation acted on.")
    progress: str | None = Field(None, description="`step/maxSteps`, for the printer column.")
    lag: int | None = Field(
        None, description="Weight versions between the trainer and the stalest rollout of its last step (lag_max)."
    )
    start_time: str | None = Field(None, description="When the job was first reconciled.")
    running_since: str | None = Field(None, description="When the phase last became Running (stall reference).")
    completion_time: str | None = Field(None, description="When the job reached Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="metav1.Condition list.")
    components: dict[str, ComponentStatus] = Field(
        default_factory=dict, description="Ready/desired pods and restarts per role."
    )
    trainer: TrainerStatus = Field(default_factory=TrainerStatus, description="Progress reported by the trainer.")
    agent: AgentStatus | None = Field(
        None, description="Multi-turn episode counters as the trainer last reported them (spec.task.environment)."
    )
    completion: Completion | None = Field(None, description="Evidence of the outcome.")
    teardown: TeardownStatus | None = Field(None, description="Ordered teardown progress.")
    trainer_restarts: int = Field(0, description="Trainer recreations counted against backoffLimit.")
    started_spec: dict[str, Any] | None = Field(
        None,
        description=(
            "The spec the running job started with (recorded at start and on resume): what its pods run and the "
            "operator decides by; later changes other than runPolicy.suspend are reported, not applied."
        ),
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    started_generation: int | None = Field(None, description="metadata.generation of startedSpec.")
