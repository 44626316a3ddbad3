"""What one policy says about the evidence."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rlkube.lifecycle.phases import Phase


@dataclass(frozen=True)
class Outcome:
    phase: str
    """Phase.SUCCEEDED or Phase.FAILED."""
    reason: str
    message: str

    @classmethod
    def failed(cls, reason: str, message: str) -> Outcome:
        return cls(Phase.FAILED, reason, message)

    @classmethod
    def succeeded(cls, reason: str, message: str) -> Outcome:
        return cls(Phase.SUCCEEDED, reason, message)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome | None = None
    wake_at: datetime | None = None
    stalled: bool | None = None
    stall_message: str = ""


UNDECIDED = Verdict()
