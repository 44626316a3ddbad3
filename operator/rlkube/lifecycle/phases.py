"""Reasons of a TrainingJob's phases and conditions, and the pod phases the operator observes, as named constants.

Every decision, the local runner, the metrics and the tests use these names, so a reason can never be spelled
two ways (kubectl wait, dashboards and alerts match on them). The phases, condition types and condition statuses
themselves are the API's enums (rlkube.api.status), re-exported here for the lifecycle's callers.
"""

from __future__ import annotations

from enum import StrEnum

from rlkube.api.status import ConditionStatus, ConditionType, Phase

__all__ = ["ConditionStatus", "ConditionType", "EventType", "Phase", "PodPhase", "Reason"]


class Reason:
    # Outcomes.
    TRAINING_FINISHED = "TrainingFinished"
    TRAINING_INTERRUPTED = "TrainingInterrupted"
    TRAINER_DID_NOT_EXIT = "TrainerDidNotExit"
    TRAINER_EXITED_WITHOUT_EVENT = "TrainerExitedWithoutFinishedEvent"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    COMPONENT_BACKOFF_LIMIT_EXCEEDED = "ComponentBackoffLimitExceeded"
    STALLED = "Stalled"
    INVALID_SPEC = "InvalidSpec"
    IMAGE_PULL_FAILED = "ImagePullFailed"  # a pod's image could not be pulled (controller/decisions/image_pull.py)
    CHECKPOINT_LOST = "CheckpointLost"  # a recreated trainer found no checkpoint where one was saved
    ZERO_ADVANTAGE_STALL = "ZeroAdvantageStall"  # every group filtered for equal rewards: the trainer starves
    INTERRUPTED = "Interrupted"  # `rlkube local` stopped by the user
    RUNNER_ERROR = "RunnerError"  # `rlkube local` lost its own Redis or could not start a process
    # Phase transitions and teardown.
    PODS_PENDING = "PodsPending"
    COMPONENTS_STARTING = "ComponentsStarting"
    ALL_COMPONENTS_READY = "AllComponentsReady"
    TRAINER_REPORTING = "TrainerReporting"
    DELETED = "Deleted"
    SUSPENDED = "Suspended"
    SUSPENDING = "Suspending"
    RESUMED = "Resumed"
    # Stall condition.
    NO_TRAINER_EVENTS = "NoTrainerEvents"
    PROGRESSING = "Progressing"
    EVENTS_RESUMED = "EventsResumed"
    NOT_RUNNING = "NotRunning"
    # Restarts.
    TRAINER_RESTARTED = "TrainerRestarted"
    COMPONENT_RESTARTED = "ComponentRestarted"
    STALE_FINISHED_EVENT = "StaleFinishedEvent"
    CHILD_RECREATED = "ChildRecreated"
    EPHEMERAL_CHECKPOINTS = "EphemeralCheckpoints"  # Warning at creation: checkpoints on an emptyDir, restarts allowed
    TTL_EXPIRED = "TTLExpired"
    # Component readiness conditions.
    STOPPED = "Stopped"
    EXTERNAL = "External"
    ALL_READY = "AllReady"
    NOT_READY = "NotReady"
    # Event source and release.
    CONNECTED = "Connected"
    REDIS_RELEASED = "RedisReleased"
    TEARING_DOWN = "TearingDown"
    ALL_PODS_GONE = "AllPodsGone"
    SPEC_CHANGE_IGNORED = "SpecChangeIgnored"
    SPEC_AS_STARTED = "SpecAsStarted"
    # An experiment tracker (spec.tracking) failed in the trainer; the job goes on (lifecycle/tracker_failures.py).
    TRACKER_FAILED = "TrackerFailed"


class PodPhase(StrEnum):
    """Kubernetes' pod phases (what the operator observes; local processes map onto them)."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class EventType(StrEnum):
    """The types of the Kubernetes Events the operator records (core/v1 Event.type)."""

    NORMAL = "Normal"
    WARNING = "Warning"
