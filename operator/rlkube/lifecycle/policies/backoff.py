"""Restart budgets: the trainer's `runPolicy.backoffLimit`, and `runPolicy.componentBackoffLimit` for every other
role (restarts counted over the role's replicas, in place or recreated), so a component that cannot run ends the
job with its exit code and termination message instead of being replaced forever."""

from __future__ import annotations

from rlkube.api.role import Role
from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.roles import START_ORDER
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def limit(spec: TrainingJobSpec, role: str) -> int:
    rp = spec.run_policy
    return rp.backoff_limit if role == Role.TRAINER else rp.component_backoff_limit


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    if spec is None:
        return UNDECIDED
    for role in START_ORDER:
        restarts, budget = ev.restarts.get(role, 0), limit(spec, role)
        if restarts <= budget:
            continue
        failure = ev.failures.get(role)
        what = f": last failure {failure.describe()}" if failure else ""
        if role == Role.TRAINER:
            return Verdict(Outcome.failed(
                Reason.BACKOFF_LIMIT_EXCEEDED,
                f"trainer failed {restarts} time(s); backoffLimit is {budget}{what}",
            ))
        return Verdict(Outcome.failed(
            Reason.COMPONENT_BACKOFF_LIMIT_EXCEEDED,
            f"{role} failed {restarts} time(s); componentBackoffLimit is {budget}{what}",
        ))
    return UNDECIDED
