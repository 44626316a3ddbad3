"""What the lifecycle says about the evidence: one type for one policy's say and for the judgement of them all.

A policy (rlkube.lifecycle.policies) returns a Verdict; `judgement.judge` folds the policies' Verdicts into one
Verdict, so the operator, `rlkube local` and the policies share a single shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from rlkube.lifecycle.phases import Phase


@dataclass(frozen=True)
class Outcome:
    phase: Phase
    """One of Phase.TERMINAL."""
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
    """The job's outcome, once a rule decides it."""
    wake_at: datetime | None = None
    """When a time-based rule can fire next (completion timeout, stall deadline)."""
    stalled: bool | None = None
    """Stall state while the rule applies (None: not running, disabled, or a finished event is pending)."""
    stall_message: str = ""


UNDECIDED = Verdict()
