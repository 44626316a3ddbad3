"""No trainer event for `runPolicy.eventTimeoutSeconds` while Running: Stalled, reported as a condition; the job
fails only with `runPolicy.failOnStall`. Not applied once a finished event is pending (the completion rules own
that time)."""

from __future__ import annotations

from datetime import timedelta

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    if spec is None:
        return UNDECIDED
    limit = spec.run_policy.event_timeout_seconds
    if not ev.running or not limit or ev.finished is not None:
        return UNDECIDED
    deadline = (ev.last_activity or ev.now) + timedelta(seconds=limit)
    if ev.now < deadline:
        return Verdict(wake_at=deadline, stalled=False)
    since = ev.last_activity.isoformat(timespec="seconds") if ev.last_activity else "the start"
    message = f"no trainer event for {limit}s (nothing since {since})"
    outcome = Outcome.failed(Reason.STALLED, message) if spec.run_policy.fail_on_stall else None
    return Verdict(outcome, stalled=True, stall_message=message)
