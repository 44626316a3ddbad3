"""How a failed experiment tracker (spec.tracking) is reported: once per tracker and job, as the condition
TrackerFailed (True, reason TrackerFailed, one line per failed tracker) and a Warning Event; the job goes on.

The rule is written once for both launchers: the operator's decisions set the condition from the trainer's
`tracker_failed` events (docs/design.md §11), `rlkube local` prints it and puts it in its summary. A trainer that
restarts and finds the same tracker failing again reports it again; it is not reported twice.
"""

from __future__ import annotations

from rlkube.api.status import ConditionType
from rlkube.lifecycle.phases import Reason

CONDITION = ConditionType.TRACKER_FAILED
REASON = Reason.TRACKER_FAILED


def line(tracker: str, message: str) -> str:
    return f"{tracker} failed: {message}" if message else f"{tracker} failed"


def reported(condition_message: str | None, tracker: str) -> bool:
    """Whether the condition's message already names this tracker's failure."""
    return any(l.startswith(f"{tracker} failed") for l in (condition_message or "").splitlines())


def merged(condition_message: str | None, tracker: str, message: str) -> str | None:
    """The condition's message with this tracker's failure added; None when it is reported already."""
    if reported(condition_message, tracker):
        return None
    return "\n".join(filter(None, [condition_message, line(tracker, message)]))
