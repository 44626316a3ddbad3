"""docs/design.md §4.1: the job succeeds when the trainer published training_finished for the final step AND exited 0.

Event without exit for completionTimeoutSeconds: the trainer is stopped, and the job succeeds only if the event
reported the final step and a checkpoint. Exit 0 without the event for as long: Failed. An event below maxSteps,
or marked interrupted (a scheduled or interrupted stop), fails the job as TrainingInterrupted.
"""

from __future__ import annotations

from datetime import timedelta

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    if spec is None:
        return UNDECIDED
    seconds = spec.run_policy.completion_timeout_seconds
    timeout = timedelta(seconds=seconds)
    max_steps = spec.algorithm.max_steps
    f = ev.finished
    full = f is not None and not f.interrupted and (f.step or 0) >= max_steps
    if f is not None and ev.trainer_exited_at is not None:
        if full:
            return Verdict(Outcome.succeeded(Reason.TRAINING_FINISHED, f"trained {f.step}/{max_steps} steps"))
        return Verdict(Outcome.failed(
            Reason.TRAINING_INTERRUPTED,
            f"training_finished at step {f.step} of {max_steps} (interrupted or scheduled stop)",
        ))
    if f is not None:
        deadline = f.read_at + timeout
        if ev.now < deadline:
            return Verdict(wake_at=deadline)
        if full and f.checkpoint:
            return Verdict(Outcome.succeeded(
                Reason.TRAINING_FINISHED,
                f"trained {f.step}/{max_steps} steps, checkpoint {f.checkpoint}; the trainer did not exit within "
                f"completionTimeoutSeconds ({seconds}s) and is stopped",
            ))
        return Verdict(Outcome.failed(
            Reason.TRAINER_DID_NOT_EXIT,
            f"training_finished (step {f.step}, checkpoint {f.checkpoint}) but the trainer did not exit within "
            f"{seconds}s, and the event lacks the final step or a checkpoint",
        ))
    if ev.trainer_exited_at is not None:
        deadline = ev.trainer_exited_at + timeout
        if ev.now < deadline:
            return Verdict(wake_at=deadline)
        return Verdict(Outcome.failed(
            Reason.TRAINER_EXITED_WITHOUT_EVENT,
            f"trainer exited 0 but published no training_finished within {seconds}s",
        ))
    return UNDECIDED
