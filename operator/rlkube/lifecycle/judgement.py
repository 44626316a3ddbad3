"""How a job ends: evidence + run policy + time -> an outcome, or when to look again (docs/design.md §4).

`judge` runs the policies in order, each a small module of `rlkube.lifecycle.policies`; the first that decides
an outcome wins. The operator and `rlkube local` both call it, so the same evidence gets the same verdict. The
judgement is itself a Verdict (lifecycle.verdict): the fold of the policies' verdicts has their shape.
"""

from __future__ import annotations

from datetime import datetime

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.policies import backoff, completion, config_error, invalid_spec, stall
from rlkube.lifecycle.verdict import Verdict

POLICIES = (invalid_spec, config_error, backoff, completion, stall)
"""In order: a bad spec or input first, then restart budgets, then the completion rules, then the stall rule."""


def judge(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    """The policies' verdicts folded into one: the first outcome, else the earliest wake-up and the stall state."""
    outcome = None
    wake_at: datetime | None = None
    stalled: bool | None = None
    stall_message = ""
    for policy in POLICIES:
        verdict: Verdict = policy.check(ev, spec)
        if verdict.wake_at is not None and (wake_at is None or verdict.wake_at < wake_at):
            wake_at = verdict.wake_at
        if verdict.stalled is not None:
            stalled, stall_message = verdict.stalled, verdict.stall_message
        if verdict.outcome is not None:
            outcome = verdict.outcome
            break
    return Verdict(outcome, None if outcome else wake_at, stalled, stall_message)
