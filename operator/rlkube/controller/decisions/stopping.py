"""Why a job stops now (an outcome, its deletion, a suspend), and the ordered teardown (decisions/teardown.py,
docs/design.md §4.4) applied to the pass: the stages, the static children deleted at its end, the Suspended phase.
"""

from __future__ import annotations

from dataclasses import replace

from rlkube.api.spec import GracePeriods
from rlkube.api.status import TeardownStatus
from rlkube.contract import protocol
from rlkube.controller.decisions import teardown
from rlkube.controller.decisions.actions import DeleteObject, DeletePod
from rlkube.controller.decisions.components import update_components
from rlkube.controller.decisions.creation import static_names
from rlkube.controller.decisions.pass_state import Pass, outcome, set_phase
from rlkube.controller.decisions.times import parse_time
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, Phase, Reason


def teardown_reason(p: Pass) -> str | None:
    """Why the job must be torn down now, or None while it should run."""
    td = p.status.teardown
    decided = outcome(p.status)
    if decided:
        return decided if td is None or td.reason in (None, Reason.SUSPENDED) else td.reason
    if td is not None and td.reason in (Reason.DELETED, Reason.SUSPENDED) and td.stage != teardown.DONE:
        return td.reason  # an ordered stop in progress is finished first
    if p.job.deleting:
        return Reason.DELETED
    if p.spec is not None and (p.spec.run_policy.suspend or p.gate.hold):
        return Reason.SUSPENDED
    return None


def _suspend_cause(p: Pass) -> str:
    if p.spec is not None and p.spec.run_policy.suspend:
        return "spec.runPolicy.suspend is set"
    return p.gate.message


def run_teardown(p: Pass, reason: str) -> bool:
    st = p.status
    td = st.teardown
    if td is None or td.reason != reason and td.stage == teardown.DONE:
        # A new teardown (a finished suspend followed by deletion or an outcome restarts the sequence).
        td = TeardownStatus(reason=reason)
        # The phase transition says it: no Event of its own.
        p.condition(ConditionType.RESOURCES_RELEASED, ConditionStatus.FALSE, Reason.TEARING_DOWN,
                    f"ordered teardown ({reason})", event=False)
    elif td.reason != reason:
        td = td.model_copy(update={"reason": reason})
    spec = p.spec
    grace = spec.teardown.grace_period_seconds if spec else GracePeriods()
    keep = spec.teardown.keep_trainer_pod if spec else False
    streams: tuple[str, ...] = ()
    if spec is not None and spec.redis.mode == "external":
        streams = tuple(protocol.StreamKeys.for_job(p.job.namespace, p.job.name, spec.trainer.backend).all())
    was_done = td.stage == teardown.DONE
    step = teardown.advance(td, list(p.obs.pods), grace, keep, p.now, streams)
    st.teardown = step.status
    p.actions += step.actions
    p.events += step.events
    if step.deadline is not None:
        p.wake_at(step.deadline)
    if step.done and not was_done:
        first = parse_time(step.status.stages[0].started_at) if step.status.stages else None
        p.teardown_seconds = (p.now - first).total_seconds() if first else 0.0
        for manifest_kind, name in static_names(p):
            p.actions.append(DeleteObject(manifest_kind, name))
        stages = "; ".join(teardown.describe(s) for s in step.status.stages)
        p.released_note = f"teardown ({reason}) finished: {stages}" if stages else f"teardown ({reason}) finished"
        # After an outcome the final phase Event (same pass) carries this; a deletion or suspend has its own.
        p.condition(ConditionType.RESOURCES_RELEASED, ConditionStatus.TRUE, Reason.ALL_PODS_GONE, p.released_note,
                    event=reason not in Phase.TERMINAL)
    return step.done


def count_deleted_as_stopping(p: Pass) -> None:
    """Pods this pass deletes are not ready from now on: the components say so in this pass's status, so the
    pass that then sees their deletionTimestamp finds nothing new to write (one status PATCH less per stage)."""
    deleted = {a.uid for a in p.actions if isinstance(a, DeletePod)}
    if not deleted:
        return
    pods = tuple(replace(pod, deleting=True) if pod.uid in deleted else pod for pod in p.obs.pods)
    p.obs = replace(p.obs, pods=pods)
    update_components(p, stopping=True)


def suspend_phase(p: Pass) -> None:
    """Suspended while the ordered stop runs (Suspending), and Suspended=True once every component is stopped."""
    if not p.released:
        set_phase(p, Phase.SUSPENDED, Reason.SUSPENDING, "ordered stop in progress")
        return
    why = p.gate.reason if p.gate.hold else Reason.SUSPENDED
    stopped = f"all components stopped: {p.gate.message}" if p.gate.hold else "all components stopped"
    p.condition(ConditionType.SUSPENDED, ConditionStatus.TRUE, why, stopped)
    set_phase(p, Phase.SUSPENDED, why, _suspend_cause(p))
