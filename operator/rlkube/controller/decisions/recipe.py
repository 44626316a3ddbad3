"""One reconcile pass as a pure function: (job, observed pods and trainer events, time) -> actions + new status.

Why pure: this is the operator's behaviour, all of it, so it is kept free of I/O (and of randomness: the managed
Redis password is minted by the applier, actions.Create.mint) and every transition has a table-driven unit test.
`decide` is a short recipe of named steps over the pass's scratch state (pass_state.Pass), their parts in the
modules beside it named for what they hold; phases and condition types are the API's enums (rlkube.api.status),
never spelled here. What it decides: start order and gates (docs/design.md §3; a gate also holds a role none of
whose pods exists yet after Running, as the trainer's first event can turn the job Running first), the outcome
and its reasons (§4.1-§4.3, through lifecycle/judgement.py), the ordered teardown (§4.4), spec changes, suspend,
Kueue and children recreated by hand (§4.5). Callers import `decide`, `JobView`, `Decision` and `outcome` here.
"""

from __future__ import annotations

import copy
from datetime import datetime, timedelta

from rlkube.api.role import Role
from rlkube.contract import checkpoint_loss
from rlkube.controller.decisions import kueue
from rlkube.controller.decisions.actions import DeleteJob
from rlkube.controller.decisions.components import update_components
from rlkube.controller.decisions.conditions import get, is_true
from rlkube.controller.decisions.creation import create_missing, update_phase
from rlkube.controller.decisions.judging import apply_judgement, fail_unpullable_image, failing_pods, handle_failures
from rlkube.controller.decisions.observed import Observed
from rlkube.controller.decisions.pass_state import Decision, JobView, Pass, outcome, set_phase
from rlkube.controller.decisions.started_spec import as_started, can_resume, report_spec_changes, resume_from_suspend
from rlkube.controller.decisions.stopping import count_deleted_as_stopping, run_teardown, suspend_phase, teardown_reason
from rlkube.controller.decisions.times import fmt_time, parse_time
from rlkube.controller.decisions.trainer_events import ingest_events, update_event_source
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, EventType, Phase, Reason

__all__ = ["Decision", "JobView", "decide", "outcome"]


def decide(job: JobView, obs: Observed, now: datetime) -> Decision:
    """Decide one reconcile pass: the steps below, in this order, each reading and writing the pass's state."""
    p = _begin(job, obs, now)
    _fail_invalid_spec(p)
    _settle_started_spec(p)
    report_spec_changes(p)
    _fail_rejected_child(p)
    ingest_events(p)
    _judge_run(p)
    if p.stop_reason is None:
        _keep_running(p)
    else:
        _stop(p)
    _watch_event_source(p)
    _release_kueue_workload(p)
    _expire_ttl(p)
    return _decision(p)


def _begin(live: JobView, obs: Observed, now: datetime) -> Pass:
    """Open the pass: the Kueue gate, the job as its pods run it (the live spec on a resume), and a first pass's
    start time (its phase Event then says the job is accepted)."""
    gate = _kueue_gate(live, obs)
    resuming = can_resume(live, gate)
    p = Pass(live if resuming else as_started(live), live, obs, now, gate, resuming)
    p.actions += gate.actions
    p.status.observed_generation = p.job.generation
    if p.status.start_time is None:
        p.status.start_time = fmt_time(now)
        p.accepting = not resuming  # no Event of its own: this pass's phase Event says it ("accepted, Pending")
        spec = p.job.spec
        ephemeral = checkpoint_loss.ephemeral_warning(spec) if p.accepting and spec is not None else None
        if ephemeral:  # once per job: a recreated trainer pod would find no checkpoint and fail the job
            p.event(EventType.WARNING, Reason.EPHEMERAL_CHECKPOINTS, ephemeral)
    return p


def _kueue_gate(live: JobView, obs: Observed) -> kueue.Gate:
    """The Kueue gate step: hold the job until its Workload is admitted (creating the Workload first)."""
    settled = live.deleting or outcome(live.status) is not None
    return kueue.gate(live.ref if live.spec is not None else None, obs.kueue, settled)


def _fail_invalid_spec(p: Pass) -> None:
    """A spec the schema could not reject fails the job (InvalidSpec); nothing is created."""
    if p.spec is None:
        p.decide_outcome(Phase.FAILED, Reason.INVALID_SPEC, p.job.spec_error or "invalid spec")


def _settle_started_spec(p: Pass) -> None:
    """A finished suspend whose flag was cleared starts again from Pending; the spec a job starts (or resumes)
    with is recorded in status.startedSpec and decides from then on."""
    if p.resuming:
        resume_from_suspend(p)
    if p.spec is not None and (p.status.started_spec is None or p.resuming):
        p.status.started_spec = copy.deepcopy(p.job.raw_spec)
        p.status.started_generation = p.job.generation


def _fail_rejected_child(p: Pass) -> None:
    """A child the API server rejected as invalid (400/422) fails the job (InvalidSpec) with the server's message."""
    rej = p.obs.create_rejected
    if rej is not None:
        p.decide_outcome(Phase.FAILED, Reason.INVALID_SPEC, f"the API server rejected {rej.kind} {rej.name}: {rej.message}")


def _judge_run(p: Pass) -> None:
    """Count the components; while the job runs, judge it (an outcome, Stalled) and replace the pods that ended too
    early. Sets `p.stop_reason`: why the job is torn down now, if it is."""
    p.stop_reason = teardown_reason(p)
    update_components(p, stopping=p.stop_reason is not None)
    if p.stop_reason is not None:
        return
    fail_unpullable_image(p)
    failing = failing_pods(p)
    apply_judgement(p, failing)
    if outcome(p.status) is None:
        handle_failures(p, failing)
    p.stop_reason = teardown_reason(p)


def _keep_running(p: Pass) -> None:
    """A running job: create what is missing, move the phase on, and judge a job that has just become Running
    (its stall clock starts with it)."""
    create_missing(p)
    update_phase(p)
    if p.was_phase != Phase.RUNNING and p.status.phase == Phase.RUNNING:
        apply_judgement(p, [])


def _stop(p: Pass) -> None:
    """The ordered teardown, and the phase it leads to: Suspended; the outcome once everything is released;
    else Draining. A stopped job is not stalled (unless the stall is what failed it)."""
    st = p.status
    assert p.stop_reason is not None
    p.released = run_teardown(p, p.stop_reason)
    count_deleted_as_stopping(p)
    decided = outcome(st)
    if p.stop_reason == Reason.SUSPENDED:
        suspend_phase(p)
    elif decided and p.released:
        cond = get(st.conditions, ConditionType(decided))
        set_phase(p, decided, cond.reason if cond else decided, cond.message if cond else "", note=p.released_note)
        st.completion_time = st.completion_time or fmt_time(p.now)
    else:
        cond = get(st.conditions, ConditionType(decided)) if decided else None
        if cond is not None:
            set_phase(p, Phase.DRAINING, cond.reason, cond.message)
        else:
            set_phase(p, Phase.DRAINING, Reason.DELETED, "the TrainingJob is being deleted")
    if is_true(st.conditions, ConditionType.STALLED) and decided != Phase.FAILED:
        p.condition(ConditionType.STALLED, ConditionStatus.FALSE, Reason.NOT_RUNNING, event=False)


def _watch_event_source(p: Pass) -> None:
    """Read the job's events while its Redis is up (not yet torn down, not suspended); EventSourceReachable says
    how that goes, and False once the Redis is released."""
    st = p.status
    p.watching = (
        p.spec is not None
        and (st.teardown is None or not any(s.name == Role.REDIS for s in st.teardown.stages))
        and not (p.stop_reason == Reason.SUSPENDED and p.released)
    )
    if p.watching:
        update_event_source(p)
    elif get(st.conditions, ConditionType.EVENT_SOURCE_REACHABLE) is not None:
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, ConditionStatus.FALSE, Reason.REDIS_RELEASED,
                    "the job's Redis is torn down", event=False)


def _release_kueue_workload(p: Pass) -> None:
    """Tell Kueue what became of an admitted job (its Workload Finished, or its quota released on a suspend)."""
    st = p.status
    p.actions += kueue.release_actions(p.obs.kueue, st.phase, p.released, st.message or "", p.now)


def _expire_ttl(p: Pass) -> None:
    """runPolicy.ttlSecondsAfterFinished: delete a finished job once it has run out, else look again then."""
    st = p.status
    if st.phase not in Phase.TERMINAL or p.ttl is None or p.job.deleting:
        return
    expires = (parse_time(st.completion_time) or p.now) + timedelta(seconds=p.ttl)
    if p.now >= expires:
        p.actions.append(DeleteJob())
        p.event(EventType.NORMAL, Reason.TTL_EXPIRED, f"deleting the job {p.ttl}s after it finished")
    else:
        p.wake_at(expires)


def _decision(p: Pass) -> Decision:
    """What the pass decided, for the loop to apply."""
    finished = p.status.phase in Phase.TERMINAL and p.released and (p.ttl is None or p.job.deleting)
    return Decision(
        status=p.status,
        actions=p.actions,
        events=p.events,
        requeue_after=None if p.deadline is None else max(0.0, (p.deadline - p.now).total_seconds()),
        watch_events=p.watching,
        released=p.released,
        finished=finished,
        teardown_seconds=p.teardown_seconds,
    )
