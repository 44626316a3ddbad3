"""What a launcher has seen of a job, reduced to the facts the judgement needs.

The operator builds it from pods, status and the trainer's events; `rlkube local` from its processes and the
same events. Times are timezone-aware datetimes on the launcher's clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class Finished:
    """The trainer's training_finished event (from the trainer incarnation that runs now)."""

    read_at: datetime
    step: int | None = None
    checkpoint: str | None = None
    interrupted: bool = False


@dataclass(frozen=True)
class Failure:
    """A role process (pod) that ended badly."""

    role: str
    name: str
    exit_code: int | None = None
    message: str = ""
    """Its termination message, if it wrote one."""

    def describe(self) -> str:
        code = f"exit code {self.exit_code}" if self.exit_code is not None else "failed"
        return f"{self.name} ({code})" + (f": {self.message}" if self.message else "")


@dataclass(frozen=True)
class Evidence:
    now: datetime
    spec_error: str | None = None
    """The spec failed validation (what the schema could not express)."""
    config_error: Failure | None = None
    """A role exited with runtime.EXIT_CONFIG: its input (model, dataset, ...) cannot work, a restart cannot help."""
    restarts: Mapping[str, int] = field(default_factory=dict)
    """Restarts per role so far, counting the failures seen now that would be restarted."""
    failures: Mapping[str, Failure] = field(default_factory=dict)
    """The latest failure of each role (for the messages)."""
    finished: Finished | None = None
    trainer_exited_at: datetime | None = None
    """When trainer rank 0 was seen to have exited 0 (None while it runs, or after a failure)."""
    running: bool = False
    """The job is in phase Running (the stall rule applies only then)."""
    last_activity: datetime | None = None
    """Newest of: the last trainer event, when the job became Running, when trainer rank 0 (re)started."""
