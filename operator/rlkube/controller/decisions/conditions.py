"""metav1.Condition bookkeeping: set a condition, keep its lastTransitionTime unless the status changes.

Separate from the decisions so the rule "a transition is a change of status, not of reason or message" lives
in one place (that is what `kubectl wait --for=condition=...` and every dashboard rely on).
"""

from __future__ import annotations

from datetime import datetime

from rlkube.api.role import Role
from rlkube.api.status import Condition, ConditionType
from rlkube.controller.decisions.times import fmt_time
from rlkube.lifecycle.phases import ConditionStatus

ROLE_CONDITIONS = {
    Role.REDIS: ConditionType.REDIS_READY,
    Role.TRAINER: ConditionType.TRAINER_READY,
    Role.INFERENCE: ConditionType.INFERENCE_READY,
    Role.PREPROCESSOR: ConditionType.PREPROCESSOR_READY,
    Role.ACTOR: ConditionType.ACTORS_READY,
    Role.SANDBOX: ConditionType.SANDBOX_READY,
}
"""The readiness condition of each role's pods."""


def get(conditions: list[Condition], type_: str) -> Condition | None:
    return next((c for c in conditions if c.type == type_), None)


def is_true(conditions: list[Condition], type_: str) -> bool:
    c = get(conditions, type_)
    return c is not None and c.status == ConditionStatus.TRUE


def set_condition(
    conditions: list[Condition],
    type_: str,
    status: str,
    reason: str,
    message: str,
    now: datetime,
    generation: int,
) -> bool:
    """Set (or add) a condition in place; True when its status changed (a transition)."""
    current = get(conditions, type_)
    if current is None:
        conditions.append(
            Condition(
                type=type_,
                status=status,
                reason=reason,
                message=message,
                last_transition_time=fmt_time(now),
                observed_generation=generation,
            )
        )
        return True
    changed = current.status != status
    current.status = status
    current.reason = reason
    current.message = message
    current.observed_generation = generation
    if changed:
        current.last_transition_time = fmt_time(now)
    return changed


def remove(conditions: list[Condition], type_: str) -> None:
    conditions[:] = [c for c in conditions if c.type != type_]
