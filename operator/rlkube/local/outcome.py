"""When a local job is done, and how it ended: design.md section 4's completion rules, as a pure function.

The operator applies the same rules to pods; here the observations are local processes. Kept pure (no I/O,
time passed in) so the rules are unit-tested without starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    now: float
    max_steps: int
    completion_timeout: float
    event_timeout: float  # 0 disables
    last_event_at: float
    finished_at: float | None = None  # when training_finished was read
    finished_step: int | None = None
    finished_checkpoint: str | None = None
    finished_interrupted: bool = False
    trainer_exit: int | None = None  # exit code once the trainer process ended
    trainer_exit_at: float | None = None
    crashed: tuple[str, int] | None = None  # (role-index, exit code) of another role that ended badly
    interrupted_by_user: bool = False


@dataclass(frozen=True)
class Outcome:
    phase: str  # "Succeeded" | "Failed"
    reason: str
    message: str


def decide(o: Observation) -> Outcome | None:
    """None while the job should keep running."""
    if o.interrupted_by_user:
        return Outcome("Failed", "Interrupted", "stopped by the user (SIGINT/SIGTERM)")
    if o.crashed is not None:
        name, code = o.crashed
        return Outcome("Failed", "ComponentFailed", f"{name} exited with code {code}")
    if o.trainer_exit is not None and o.trainer_exit != 0:
        return Outcome("Failed", "TrainerFailed", f"trainer exited with code {o.trainer_exit}")

    full = o.finished_step is not None and o.finished_step >= o.max_steps and not o.finished_interrupted
    if o.finished_at is not None and o.trainer_exit == 0:
        if full:
            return Outcome("Succeeded", "TrainingFinished", f"trained {o.finished_step}/{o.max_steps} steps")
        return Outcome(
            "Failed", "TrainingInterrupted", f"training_finished at step {o.finished_step} of {o.max_steps}"
        )
    if o.finished_at is not None and o.now - o.finished_at > o.completion_timeout:
        # The event came but the trainer hangs: it is stopped, and the run counts only if the event is complete.
        if full and o.finished_checkpoint:
            return Outcome("Succeeded", "TrainingFinished", "trainer did not exit; final step and checkpoint reported")
        return Outcome("Failed", "TrainerDidNotExit", "training_finished without final step/checkpoint, no exit")
    if o.trainer_exit == 0 and o.trainer_exit_at is not None and o.now - o.trainer_exit_at > o.completion_timeout:
        return Outcome(
            "Failed", "TrainerExitedWithoutFinishedEvent", "trainer exited 0 but never published training_finished"
        )
    if o.event_timeout and o.finished_at is None and o.now - o.last_event_at > o.event_timeout:
        return Outcome("Failed", "Stalled", f"no trainer event for {o.event_timeout:.0f}s")
    return None
