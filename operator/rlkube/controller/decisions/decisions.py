"""One reconcile pass as a pure function: (job, observed pods and trainer events, time) -> actions + new status.

Why pure: this is the operator's behaviour, all of it, so it is kept free of I/O (and of randomness: the managed
Redis password is minted by the applier, actions.Create.mint) and every transition has a table-driven unit test.
`decide` is a short recipe of named steps over the pass's scratch state (`_Pass`); phases and condition types are
the API's enums (rlkube.api.status), never spelled here. What it decides: start order and gates (docs/design.md
§3; a gate also holds a role none of whose pods exists yet after Running, as the trainer's first event can turn
the job Running first), the outcome and its reasons (§4.1-§4.3, through lifecycle/judgement.py), the ordered
teardown (§4.4), spec changes, suspend, Kueue and children recreated by hand (§4.5).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

import orjson

from rlkube.api.spec import GracePeriods, TrainingJobSpec
from rlkube.api.status import (
    AgentStatus,
    CheckpointRef,
    Completion,
    ComponentStatus,
    TeardownStatus,
    TrainingJobStatus,
)
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.decisions import image_pull, kueue, specdiff, teardown
from rlkube.controller.manifests import builders, fastllm, names
from rlkube.controller.decisions.actions import (
    Action,
    Create,
    DeleteJob,
    DeleteObject,
    DeletePod,
    Event,
)
from rlkube.controller.decisions.conditions import (
    ROLE_CONDITIONS,
    get,
    is_true,
    remove,
    set_condition,
)
from rlkube.controller.decisions.observed import Observed, PodView
from rlkube.controller.decisions.times import fmt_time, parse_time, stream_id_key, stream_id_time
from rlkube.contract import protocol, runtime
from rlkube.contract import checkpoint_loss
from rlkube.lifecycle import progress, roles, tracker_failures
from rlkube.lifecycle.evidence import Evidence, Failure, Finished
from rlkube.lifecycle.judgement import judge
from rlkube.lifecycle.phases import ConditionType, Phase, PodPhase, Reason

UNREAD_RECHECK_SECONDS = 2.0
"""How soon a pass looks again at a producer that exited 0 while the event stream could not be read to its end."""
REPLACED_MEMORY = 20
"""How many replaced-pod UIDs a component remembers (enough: a UID matters only while its pod exists)."""

@dataclass(frozen=True)
class JobView:
    """The TrainingJob as one pass sees it."""

    namespace: str
    name: str
    uid: str
    generation: int
    raw_spec: dict[str, Any]
    spec: TrainingJobSpec | None
    """None when the spec failed semantic validation (then `spec_error` says why)."""
    spec_error: str | None
    deleting: bool
    status: TrainingJobStatus

    @property
    def ref(self) -> builders.JobRef:
        assert self.spec is not None
        return builders.JobRef(self.namespace, self.name, self.uid, self.spec, self.raw_spec)


@dataclass
class Decision:
    status: TrainingJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Seconds until a time-based rule can fire (grace period, completion or stall timeout, TTL)."""
    watch_events: bool = False
    """Whether the job's Redis event stream should be read now."""
    released: bool = False
    """The ordered teardown has finished (what a deletion waits for)."""
    finished: bool = False
    """Terminal and released with nothing left to wait for: the per-job loop may stop."""
    teardown_seconds: float | None = None
    """Set on the pass that finished a teardown: how long it took (for the metrics)."""


def outcome(status: TrainingJobStatus) -> Phase | None:
    """The decided outcome (one of Phase.TERMINAL, recorded as the condition of the same name), or None while
    undecided. At most one is ever True: an outcome is decided once (`_Pass.decide_outcome`)."""
    return next((phase for phase in Phase.TERMINAL if is_true(status.conditions, ConditionType(phase))), None)


class _Pass:
    """Mutable scratch state of one decision; `decide` orchestrates the steps below."""

    def __init__(self, job: JobView, live: JobView, obs: Observed, now: datetime, gate: kueue.Gate, resuming: bool):
        self.job = job
        """The job as its pods run it (the spec it started with; `_as_started`)."""
        self.live_job = live
        """The job as the API server has it now (what spec changes are reported against)."""
        self.gate = gate
        """The Kueue gate of this pass: while it holds, the job is suspended."""
        self.resuming = resuming
        """A finished suspend whose flag was cleared: this pass starts the job again from the spec as it is now."""
        self.spec = job.spec
        self.obs = obs
        self.now = now
        self.status = job.status.model_copy(deep=True)
        self.was_phase = job.status.phase
        self.stop_reason: str | None = None
        """Why the job is being torn down in this pass (an outcome, Deleted or Suspended); None while it runs."""
        self.released = False
        """The ordered teardown has finished."""
        self.watching = False
        """The job's Redis event stream should be read now."""
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.deadline: datetime | None = None
        self.replaced_now: set[str] = set()
        self.trainer_failed_now = False
        self.teardown_seconds: float | None = None
        self.accepting = False
        """A new job's first pass: its phase Event says the job is accepted."""
        self.released_note = ""
        """Set by the pass whose teardown finished: what it took (stage by stage)."""
        self.fresh = job.status.start_time is None
        """This pass creates the children for the first time (a new job, or a resume): nothing is "recreated"."""

    # -- helpers ------------------------------------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def condition(self, type_: ConditionType, status: str, reason: str, message: str = "", event: bool = True) -> None:
        changed = set_condition(self.status.conditions, type_, status, reason, message, self.now, self.job.generation)
        if changed and event:
            bad = (status == "True" and type_ in (ConditionType.FAILED, ConditionType.STALLED)) or (
                status == "False" and type_ == ConditionType.EVENT_SOURCE_REACHABLE
            )
            self.event("Warning" if bad else "Normal", reason, f"{type_}={status}: {message}".rstrip(": "))

    def wake_at(self, when: datetime) -> None:
        if self.deadline is None or when < self.deadline:
            self.deadline = when

    def live(self, role: str) -> list[PodView]:
        return [p for p in self.obs.role_pods(role) if not p.deleting]

    def rank0(self) -> PodView | None:
        return next((p for p in self.live("trainer") if p.index == 0), None)

    def decide_outcome(self, phase: Phase, reason: str, message: str) -> None:
        """Record the outcome (once, never changed) as the condition named like the terminal phase."""
        if outcome(self.status) is not None:
            return
        # Succeeded needs no Event of its own: the phase transitions (-> Draining, -> Succeeded) carry its reason.
        self.condition(ConditionType(phase), "True", reason, message, event=phase != Phase.SUCCEEDED)
        self.status.reason = reason
        self.status.message = message

    @property
    def max_steps(self) -> int:
        return self.spec.algorithm.max_steps if self.spec else 0

    @property
    def ttl(self) -> int | None:
        """runPolicy.ttlSecondsAfterFinished."""
        return self.spec.run_policy.ttl_seconds_after_finished if self.spec else None


# -- trainer events -----------------------------------------------------------------------------------


def _ingest_events(p: _Pass) -> None:
    tr = p.status.trainer
    for ev in p.obs.events:
        if stream_id_key(ev.stream_id) <= stream_id_key(tr.last_event_id):
            continue  # already accounted for (a re-read after an operator restart)
        facts = progress.read(ev)
        if facts.step is not None:
            tr.step = facts.step
        if facts.weights_version is not None:
            tr.weights_version = facts.weights_version
        if facts.documents_seen is not None:
            tr.documents_seen = facts.documents_seen
        if facts.lag is not None:
            p.status.lag = facts.lag
        if facts.reward_mean is not None:
            tr.reward_mean = facts.reward_mean
        if facts.tokens_per_s is not None:
            tr.tokens_per_second = facts.tokens_per_s
        if facts.checkpoint is not None:
            tr.last_checkpoint = CheckpointRef(step=facts.checkpoint[0], path=facts.checkpoint[1])
        if facts.evaluation is not None:
            tr.eval_version, tr.eval_reward_mean = facts.evaluation
            counts = facts.evaluation_counts or {}
            tr.eval_prompts, tr.eval_skipped = counts.get("prompts"), counts.get("skipped")
            tr.eval_reward_errors = counts.get("reward_errors")
        if facts.agent is not None:
            previous = p.status.agent.model_dump(by_alias=False) if p.status.agent else None
            p.status.agent = AgentStatus.model_validate(progress.fold_agent(previous, facts.agent))
        if facts.tracker_failure is not None:
            _report_tracker_failure(p, *facts.tracker_failure)
        if facts.finished and outcome(p.status) is None:
            final_step = facts.step if facts.step is not None else tr.step
            checkpoint = facts.checkpoint[1] if facts.checkpoint else None
            if facts.step is None and not facts.interrupted and p.spec is not None and (
                    p.spec.trainer.backend == "fast-llm"):
                # Fast-LLM's training_finished carries no step: it stands for its final step and checkpoint, not
                # for the last weights_ready (none comes for a skipped update) (docs/design.md §8).
                final_step, checkpoint = fastllm.finished(p.spec)
            previous = p.status.completion or Completion()
            p.status.completion = previous.model_copy(
                update={
                    "stream_id": ev.stream_id,
                    "event_time": fmt_time(p.now),
                    "final_step": final_step,
                    "checkpoint": checkpoint,
                    "interrupted": facts.interrupted or final_step < p.max_steps,
                }
            )
            # No Event: the transition it leads to (-> Draining) says it ("trained N/M steps").
        tr.last_event_id = ev.stream_id
        if facts.from_trainer:  # an actor's evaluation is no sign of trainer life (docs/design.md §4.3)
            tr.last_event_time = fmt_time(p.now)
    if p.obs.read_upto and stream_id_key(p.obs.read_upto) > stream_id_key(tr.last_event_id):
        tr.last_event_id = p.obs.read_upto  # only malformed/unknown entries beyond the last event: skip them
    if p.spec is not None:
        tr.max_steps = p.spec.algorithm.max_steps
        p.status.progress = f"{tr.step}/{tr.max_steps}"


def _report_tracker_failure(p: _Pass, tracker: str, message: str) -> None:
    """A tracker the trainer could not log to (spec.tracking): condition TrackerFailed and a Warning Event, once per
    tracker (lifecycle/tracker_failures.py); the job goes on."""
    current = get(p.status.conditions, tracker_failures.CONDITION)
    text = tracker_failures.merged(current.message if current else None, tracker, message)
    if text is None:
        return
    p.condition(tracker_failures.CONDITION, "True", tracker_failures.REASON, text, event=False)
    p.event("Warning", tracker_failures.REASON, f"{tracker_failures.line(tracker, message)} (training goes on)")


# -- components: counts, restarts, readiness ------------------------------------------------------


def _restarts(p: _Pass, role: str, comp: ComponentStatus) -> int:
    return comp.restarts_of_replaced_pods + sum(
        pod.restart_count for pod in p.obs.role_pods(role) if pod.uid not in comp.replaced_pods
    )


def _update_components(p: _Pass, stopping: bool) -> None:
    spec = p.spec
    for role in roles.START_ORDER:
        desired = roles.replicas(spec, role) if spec else 0
        if role == roles.SANDBOX and desired == 0 and role not in p.status.components and not p.obs.role_pods(role):
            continue  # snippets run in the actors' processes (spec.sandbox.mode): no component to report
        comp = p.status.components.get(role) or ComponentStatus()
        comp = comp.model_copy(deep=True)
        comp.desired = desired
        live = p.live(role)
        comp.ready = sum(1 for pod in live if pod.ready and pod.phase == PodPhase.RUNNING)
        counted = _restarts(p, role, comp)
        if counted < comp.restarts:
            # A pod with restarts is gone (deleted by teardown or by hand): keep what it had counted.
            comp.restarts_of_replaced_pods += comp.restarts - counted
            counted = comp.restarts
        comp.restarts = counted
        p.status.components[role] = comp
        ctype = ROLE_CONDITIONS[role]
        if stopping:
            left = len(p.obs.role_pods(role))
            p.condition(ctype, "False", Reason.STOPPED, f"{left} pod(s) left" if left else "", event=False)
        elif desired == 0 and role == roles.SANDBOX:
            p.condition(ctype, "False", Reason.STOPPED, "spec.sandbox.mode is process", event=False)
        elif desired == 0:
            # External Redis: ready means the operator can read the job's events from it.
            reachable = p.obs.event_source.state == "Reachable"
            p.condition(ctype, "True" if reachable else "False", Reason.EXTERNAL, "external Redis (spec.redis.url)",
                        event=False)
        elif comp.ready >= desired:
            # No Event: the phase's "-> Running: AllComponentsReady" says it for all of them at once (Events are
            # API writes: one per component per job adds up at scale); a pod that failed has its Warning.
            p.condition(ctype, "True", Reason.ALL_READY, f"{comp.ready}/{desired} ready", event=False)
        else:
            waiting = sorted({pod.waiting_reason for pod in live if pod.waiting_reason})
            detail = f"; waiting: {', '.join(waiting)}" if waiting else ""
            p.condition(ctype, "False", Reason.NOT_READY, f"{comp.ready}/{desired} ready{detail}", event=False)
    p.status.trainer_restarts = p.status.components["trainer"].restarts


def _replace(p: _Pass, pod: PodView, why: str) -> None:
    """Delete a pod that ended too early, counting it once; the creation path brings a fresh one."""
    comp = p.status.components[pod.role]
    comp.restarts_of_replaced_pods += pod.restart_count + 1
    comp.replaced_pods = (comp.replaced_pods + [pod.uid])[-REPLACED_MEMORY:]
    comp.restarts = _restarts(p, pod.role, comp)
    p.replaced_now.add(pod.uid)
    p.actions.append(DeletePod(pod.name, pod.uid, 0, pod.role))
    reason = Reason.TRAINER_RESTARTED if pod.role == roles.TRAINER else Reason.COMPONENT_RESTARTED
    p.event("Warning", reason, f"pod {pod.name} {why}; replacing it")


def _failing_pods(p: _Pass) -> list[tuple[PodView, str]]:
    """Pods that ended before they should have and must be replaced (nothing is changed yet)."""
    finished_event = p.status.completion is not None and p.status.completion.stream_id is not None
    out = []
    for role in roles.START_ORDER:
        comp = p.status.components.get(role)
        if comp is None:
            continue
        for pod in p.live(role):
            if pod.uid in comp.replaced_pods:
                continue
            code = f"exit code {pod.exit_code}" if pod.exit_code is not None else pod.phase
            if pod.phase == PodPhase.FAILED:
                out.append((pod, f"failed ({code})" if role == roles.TRAINER else f"ended ({code}) before training finished"))
            elif role != roles.TRAINER and pod.phase == PodPhase.SUCCEEDED and not finished_event:
                # Producers stop by themselves on training_finished: exit 0 is a failure only if that event is
                # really not in the stream, not merely unread yet (operator restart, a watcher that lags).
                # Only a read to the stream's end made after this pod was seen ended proves that; without one
                # (Redis unreachable) wait and look again.
                if p.obs.events_read_to_end:
                    out.append((pod, f"ended ({code}) before training finished"))
                else:
                    p.wake_at(p.now + timedelta(seconds=UNREAD_RECHECK_SECONDS))
    return out


def _failure(pod: PodView) -> Failure:
    code = pod.exit_code if pod.exit_code is not None else pod.last_exit_code
    return Failure(pod.role, pod.name, code, pod.termination_message or "")


def _evidence(p: _Pass, failing: list[tuple[PodView, str]]) -> Evidence:
    """The judgement's view of this pass. Side effects on the status: a stale finished event is dropped, and
    rank 0's exit 0 is recorded as completion evidence (once)."""
    restarts = {role: c.restarts for role, c in p.status.components.items()}
    failures: dict[str, Failure] = {}
    for pod in sorted(p.obs.pods, key=lambda x: x.finished_at or datetime.min.replace(tzinfo=p.now.tzinfo)):
        if pod.restart_count or pod.phase == PodPhase.FAILED:
            failures[pod.role] = _failure(pod)
    for pod, _ in failing:
        restarts[pod.role] = restarts.get(pod.role, 0) + 1
        failures[pod.role] = _failure(pod)
    previous = p.job.status.components.get(roles.TRAINER)
    p.trainer_failed_now = restarts.get(roles.TRAINER, 0) > (previous.restarts if previous else 0)
    config = next(
        (_failure(pod) for pod in p.obs.pods if runtime.EXIT_CONFIG in (pod.exit_code, pod.last_exit_code)), None
    )

    comp = p.status.completion
    rank0 = p.rank0()
    if comp is not None and comp.stream_id is not None:
        # A training_finished from a trainer incarnation that has since been restarted is no evidence.
        stale = p.trainer_failed_now or (
            rank0 is not None and rank0.started_at is not None and stream_id_time(comp.stream_id) < rank0.started_at
        )
        if stale:
            p.event("Warning", Reason.STALE_FINISHED_EVENT,
                    f"ignoring training_finished {comp.stream_id}: trainer restarted")
            comp = p.status.completion = None
    if rank0 is not None and rank0.phase == PodPhase.SUCCEEDED and (comp is None or comp.trainer_exit_code is None):
        comp = p.status.completion = (comp or Completion()).model_copy(
            update={"trainer_exit_code": 0, "trainer_exit_time": fmt_time(p.now)}
        )
        # No Event: the phase transition this leads to (-> Draining) says why the job ends.
    finished = None
    if comp is not None and comp.stream_id is not None:
        finished = Finished(
            read_at=parse_time(comp.event_time) or p.now,
            step=comp.final_step,
            checkpoint=comp.checkpoint,
            interrupted=bool(comp.interrupted),
        )
    exited_at = (parse_time(comp.trainer_exit_time) or p.now) if comp and comp.trainer_exit_code == 0 else None
    refs = [parse_time(p.status.trainer.last_event_time), parse_time(p.status.running_since)]
    refs.append(rank0.started_at if rank0 else None)
    return Evidence(
        now=p.now,
        config_error=config,
        restarts=restarts,
        failures=failures,
        finished=finished,
        trainer_exited_at=exited_at,
        running=p.status.phase == Phase.RUNNING,
        last_activity=max((r for r in refs if r is not None), default=None),
    )


def _judge(p: _Pass, failing: list[tuple[PodView, str]]) -> None:
    """Apply the lifecycle's judgement: an outcome, the Stalled condition, and when to look again."""
    verdict = judge(_evidence(p, failing), p.spec)
    if verdict.wake_at is not None:
        p.wake_at(verdict.wake_at)
    if verdict.stalled is None:
        if is_true(p.status.conditions, ConditionType.STALLED):
            p.condition(ConditionType.STALLED, "False", Reason.NOT_RUNNING)
    elif verdict.stalled:
        p.condition(ConditionType.STALLED, "True", Reason.NO_TRAINER_EVENTS, verdict.stall_message)
    else:
        was = is_true(p.status.conditions, ConditionType.STALLED)
        p.condition(ConditionType.STALLED, "False", Reason.EVENTS_RESUMED if was else Reason.PROGRESSING, event=was)
    if verdict.outcome is not None:
        o = verdict.outcome
        p.decide_outcome(o.phase, o.reason, o.message)


def _handle_failures(p: _Pass, failing: list[tuple[PodView, str]]) -> None:
    """Replace the pods that ended too early (the judgement found every budget still open)."""
    backoff = p.spec.run_policy.backoff_limit
    before = p.status.components[roles.TRAINER].restarts
    for pod, why in failing:
        if pod.role == roles.TRAINER:
            n = p.status.components[roles.TRAINER].restarts + 1
            ckpt = p.status.trainer.last_checkpoint
            resume = f", resuming from checkpoint step {ckpt.step}" if ckpt else ""
            why = f"{why}, restart {n} of {backoff}{resume}"
        _replace(p, pod, why)
    trainer = p.status.components[roles.TRAINER]
    p.status.trainer_restarts = trainer.restarts
    previous = p.job.status.components.get(roles.TRAINER)
    in_place = before - (previous.restarts if previous else 0)
    if in_place > 0:
        p.event("Warning", Reason.TRAINER_RESTARTED,
                f"trainer restarted in place ({trainer.restarts} restart(s) so far)")


def _condition_status(p: _Pass, type_: str) -> str | None:
    return next((c.status for c in p.status.conditions if c.type == type_), None)


def _update_event_source(p: _Pass) -> None:
    src = p.obs.event_source
    if src.state == "Reachable":
        # An Event only for a recovery: the first connection is routine (the condition records it).
        was = _condition_status(p, ConditionType.EVENT_SOURCE_REACHABLE)
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, "True", Reason.CONNECTED, src.message, event=was == "False")
    elif src.state == "Unreachable":
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, "False", src.reason, src.message)
    else:
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, "Unknown", src.reason, src.message, event=False)


# -- creation -------------------------------------------------------------------------------------


def _create_missing(p: _Pass) -> None:
    job = p.job.ref
    if any(f"{kind}/{name}" not in p.obs.static_present for kind, name in _static_names(p)):
        for manifest in builders.static_children(job):
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            if f"{kind}/{name}" not in p.obs.static_present:
                # The managed Redis password: minted by the applier for this creation only, never by a pass.
                p.actions.append(Create(manifest, mint=names.SECRET_KEY if kind == "Secret" else None))
                if not p.fresh:
                    p.event("Warning", Reason.CHILD_RECREATED, f"{kind} {name} was missing (deleted by hand?); recreated it")
    present = {pod.name for pod in p.obs.pods}
    gated = p.status.phase in (Phase.PENDING, Phase.STARTING)
    exist = {r: sum(n in present for n in builders.pod_names(job, r)) for r in roles.START_ORDER}
    ready = {r: c.ready for r, c in p.status.components.items()}
    ckpt = p.status.trainer.last_checkpoint
    for role in roles.START_ORDER:  # each gate sees what this pass already created
        # A role none of whose pods exists starts through its gate in any phase: the trainer's first event turns the
        # job Running while the sandbox pods (or inference) may not be ready yet, and the actors must still wait.
        first = exist[role] == 0
        if (gated or first) and not roles.may_start(job.spec, role, roles.StartState(exist, ready)):
            continue
        for i in range(roles.replicas(job.spec, role)):
            if names.pod_name(job.name, role, i) in present:
                continue
            resume = ckpt.path if (role == roles.TRAINER and ckpt) else None
            placement = p.gate.placements.get(role)
            p.actions.append(Create(builders.pod(job, role, i, resume_checkpoint=resume, placement=placement)))
            present.add(names.pod_name(job.name, role, i))
            exist[role] += 1


def _update_phase(p: _Pass) -> None:
    st = p.status
    if st.phase in (Phase.PENDING, Phase.STARTING):
        anything_running = any(pod.running for pod in p.obs.pods)
        all_ready = all(c.ready >= c.desired for c in st.components.values())
        if all_ready or st.trainer.last_event_id is not None:
            _set_phase(p, Phase.RUNNING, Reason.ALL_COMPONENTS_READY if all_ready else Reason.TRAINER_REPORTING)
            st.running_since = fmt_time(p.now)
        elif anything_running:
            _set_phase(p, Phase.STARTING, Reason.COMPONENTS_STARTING, "waiting for every component to be Ready")
        else:
            _set_phase(p, Phase.PENDING, Reason.PODS_PENDING, "children created, no pod running yet")


def _set_phase(p: _Pass, phase: Phase, reason: str, message: str = "", note: str = "") -> None:
    """Set the phase; a change gets an Event, which also says `note` (not kept in the status)."""
    st = p.status
    if st.phase != phase or p.accepting:
        change = f"accepted, {phase}" if p.accepting else f"{st.phase} -> {phase}"
        p.accepting = False
        text = f"{change}: {reason} {message}".strip() + (f"; {note}" if note else "")
        p.event("Warning" if phase == Phase.FAILED else "Normal", phase, text)
    st.phase = phase
    st.reason = reason
    st.message = message


# -- teardown -------------------------------------------------------------------------------------


def _teardown_reason(p: _Pass) -> str | None:
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


def _suspend_cause(p: _Pass) -> str:
    if p.spec is not None and p.spec.run_policy.suspend:
        return "spec.runPolicy.suspend is set"
    return p.gate.message


def _run_teardown(p: _Pass, reason: str) -> bool:
    st = p.status
    td = st.teardown
    if td is None or td.reason != reason and td.stage == teardown.DONE:
        # A new teardown (a finished suspend followed by deletion or an outcome restarts the sequence).
        td = TeardownStatus(reason=reason)
        # The phase transition says it: no Event of its own.
        p.condition(ConditionType.RESOURCES_RELEASED, "False", Reason.TEARING_DOWN, f"ordered teardown ({reason})", event=False)
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
        for manifest_kind, name in _static_names(p):
            p.actions.append(DeleteObject(manifest_kind, name))
        stages = "; ".join(teardown.describe(s) for s in step.status.stages)
        p.released_note = f"teardown ({reason}) finished: {stages}" if stages else f"teardown ({reason}) finished"
        # After an outcome the final phase Event (same pass) carries this; a deletion or suspend has its own.
        p.condition(ConditionType.RESOURCES_RELEASED, "True", Reason.ALL_PODS_GONE, p.released_note,
                    event=reason not in Phase.TERMINAL)
    return step.done


def _count_deleted_as_stopping(p: _Pass) -> None:
    """Pods this pass deletes are not ready from now on: the components say so in this pass's status, so the
    pass that then sees their deletionTimestamp finds nothing new to write (one status PATCH less per stage)."""
    deleted = {a.uid for a in p.actions if isinstance(a, DeletePod)}
    if not deleted:
        return
    pods = tuple(replace(pod, deleting=True) if pod.uid in deleted else pod for pod in p.obs.pods)
    p.obs = replace(p.obs, pods=pods)
    _update_components(p, stopping=True)


def _static_names(p: _Pass) -> list[tuple[str, str]]:
    job = p.job.name
    out = [("ConfigMap", names.config_name(job))]
    managed = p.spec is None or p.spec.redis.mode == "managed"
    if managed:
        out += [("Secret", names.secret_name(job)), ("NetworkPolicy", names.network_policy_name(job))]
    if p.spec is None:
        out += [("Service", names.service_name(job, r)) for r in names.SERVICE_ROLES if r not in ("redis", "sandbox")
                or (r == "redis" and managed)]
        return out
    if roles.uses_sandbox_pods(p.spec):
        out.append(("NetworkPolicy", names.sandbox_network_policy_name(job)))
    out += [("Service", names.service_name(job, r)) for r in builders.service_roles(p.spec)]
    return out


def _can_resume(job: JobView, gate: kueue.Gate) -> bool:
    st = job.status
    return (
        st.phase == Phase.SUSPENDED
        and st.teardown is not None
        and st.teardown.stage == teardown.DONE
        and job.spec is not None
        and not job.spec.run_policy.suspend
        and not gate.hold
        and not job.deleting
    )


def _as_started(live: JobView) -> JobView:
    """The job as its pods run it: the spec it started with, runPolicy.suspend (and deletion) as they are now."""
    started = live.status.started_spec
    if started is None:
        return live
    raw = specdiff.with_live_fields(started, live.raw_spec)
    spec = _parse_started(orjson.dumps(raw, option=orjson.OPT_SORT_KEYS))
    if spec is None:
        return live  # recorded by an operator whose schema differed: act on the current spec
    return replace(live, raw_spec=raw, spec=spec, spec_error=None)


@functools.lru_cache(maxsize=1024)
def _parse_started(raw_json: bytes) -> Any:
    """The started spec, validated once per distinct spec rather than on every pass (a pure function of the
    JSON, and nothing modifies a parsed spec); None when it does not validate."""
    try:
        return parse_spec(orjson.loads(raw_json))
    except SpecError:
        return None


def _report_spec_changes(p: _Pass) -> None:
    """Spec changes while the job runs are not applied: one Warning Event per distinct set of ignored changes, and
    the condition SpecChangeIgnored says which while they last."""
    st = p.status
    live = p.live_job
    suspending = bool((live.raw_spec.get("runPolicy") or {}).get("suspend"))
    if st.started_spec is None or st.phase not in (Phase.PENDING, Phase.STARTING, Phase.RUNNING, Phase.DRAINING) or live.deleting:
        return
    if suspending:
        return  # the change is applied when the job resumes: nothing is ignored
    paths = specdiff.changed_paths(st.started_spec, live.raw_spec)
    previous = get(st.conditions, ConditionType.SPEC_CHANGE_IGNORED)
    if paths:
        message = (
            f"{specdiff.describe(paths)} changed after the job started (generation {st.started_generation} -> "
            f"{live.generation}); not applied to the running job (suspend and resume it to apply)"
        )
        # The generations in the message change with every edit; the Event only when the paths do.
        if previous is None or previous.status != "True" or not previous.message.startswith(specdiff.describe(paths) + " "):
            p.event("Warning", Reason.SPEC_CHANGE_IGNORED, message)
        p.condition(ConditionType.SPEC_CHANGE_IGNORED, "True", Reason.SPEC_CHANGE_IGNORED, message, event=False)
    elif previous is not None and previous.status == "True":
        p.condition(ConditionType.SPEC_CHANGE_IGNORED, "False", Reason.SPEC_AS_STARTED, "the spec is back to the one the job started with",
                    event=False)


def _kueue_gate(live: JobView, obs: Observed) -> kueue.Gate:
    """The Kueue gate step: hold the job until its Workload is admitted (creating the Workload first)."""
    settled = live.deleting or outcome(live.status) is not None
    return kueue.gate(live.ref if live.spec is not None else None, obs.kueue, settled)


def _resume_from_suspend(p: _Pass) -> None:
    st = p.status
    st.teardown = None
    st.completion = None
    st.running_since = None
    st.trainer.last_event_id = None  # the next Redis (and its streams) is a new one
    remove(st.conditions, ConditionType.RESOURCES_RELEASED)
    remove(st.conditions, ConditionType.STALLED)
    remove(st.conditions, ConditionType.SPEC_CHANGE_IGNORED)
    p.fresh = True
    why = p.gate.message if p.gate.reason else "spec.runPolicy.suspend unset"
    p.condition(ConditionType.SUSPENDED, "False", Reason.RESUMED, why)
    _set_phase(p, Phase.PENDING, Reason.RESUMED, "recreating the components")


# -- the pass -------------------------------------------------------------------------------------


def decide(job: JobView, obs: Observed, now: datetime) -> Decision:
    """Decide one reconcile pass: the steps below, in this order, each reading and writing the pass's state."""
    p = _begin(job, obs, now)
    _fail_invalid_spec(p)
    _settle_started_spec(p)
    _report_spec_changes(p)
    _fail_rejected_child(p)
    _ingest_events(p)
    _judge_run(p)
    if p.stop_reason is None:
        _keep_running(p)
    else:
        _stop(p)
    _watch_event_source(p)
    _release_kueue_workload(p)
    _expire_ttl(p)
    return _decision(p)


def _begin(live: JobView, obs: Observed, now: datetime) -> _Pass:
    """Open the pass: the Kueue gate, the job as its pods run it (the live spec on a resume), and a first pass's
    start time (its phase Event then says the job is accepted)."""
    gate = _kueue_gate(live, obs)
    resuming = _can_resume(live, gate)
    p = _Pass(live if resuming else _as_started(live), live, obs, now, gate, resuming)
    p.actions += gate.actions
    p.status.observed_generation = p.job.generation
    if p.status.start_time is None:
        p.status.start_time = fmt_time(now)
        p.accepting = not resuming  # no Event of its own: this pass's phase Event says it ("accepted, Pending")
        spec = p.job.spec
        ephemeral = checkpoint_loss.ephemeral_warning(spec) if p.accepting and spec is not None else None
        if ephemeral:  # once per job: a recreated trainer pod would find no checkpoint and fail the job
            p.event("Warning", Reason.EPHEMERAL_CHECKPOINTS, ephemeral)
    return p


def _fail_invalid_spec(p: _Pass) -> None:
    """A spec the schema could not reject fails the job (InvalidSpec); nothing is created."""
    if p.spec is None:
        p.decide_outcome(Phase.FAILED, Reason.INVALID_SPEC, p.job.spec_error or "invalid spec")


def _settle_started_spec(p: _Pass) -> None:
    """A finished suspend whose flag was cleared starts again from Pending; the spec a job starts (or resumes)
    with is recorded in status.startedSpec and decides from then on."""
    if p.resuming:
        _resume_from_suspend(p)
    if p.spec is not None and (p.status.started_spec is None or p.resuming):
        p.status.started_spec = copy.deepcopy(p.job.raw_spec)
        p.status.started_generation = p.job.generation


def _fail_rejected_child(p: _Pass) -> None:
    """A child the API server rejected as invalid (400/422) fails the job (InvalidSpec) with the server's message."""
    rej = p.obs.create_rejected
    if rej is not None:
        p.decide_outcome(Phase.FAILED, Reason.INVALID_SPEC, f"the API server rejected {rej.kind} {rej.name}: {rej.message}")


def _fail_unpullable_image(p: _Pass) -> None:
    """A pod whose image pull has failed for spec.runPolicy.imagePullTimeoutSeconds since the operator first saw
    it fail (at once for a reason no retry cures) fails the job, naming the image field (decisions/image_pull.py);
    until then, look again at its deadline. When each failure was first seen is kept in the status."""
    if p.spec is None:
        return
    live = [pod for pod in p.obs.pods if not pod.terminated]
    seen = {uid: t for comp in p.status.components.values() for uid, raw in comp.pull_failing_since.items()
            if (t := parse_time(raw)) is not None}
    failing = image_pull.unpullable(live, seen, p.now)
    for role, comp in p.status.components.items():
        comp.pull_failing_since = {u.pod.uid: fmt_time(u.since) for u in failing
                                   if u.pod.role == role and u.since is not None}
    timeout_s = p.spec.run_policy.image_pull_timeout_seconds
    failed, wake = image_pull.overdue(failing, timeout_s, p.now)
    if failed is not None:
        p.decide_outcome(Phase.FAILED, Reason.IMAGE_PULL_FAILED, failed.message(p.spec, timeout_s))
    elif wake is not None:
        p.wake_at(wake)


def _judge_run(p: _Pass) -> None:
    """Count the components; while the job runs, judge it (an outcome, Stalled) and replace the pods that ended too
    early. Sets `p.stop_reason`: why the job is torn down now, if it is."""
    p.stop_reason = _teardown_reason(p)
    _update_components(p, stopping=p.stop_reason is not None)
    if p.stop_reason is not None:
        return
    _fail_unpullable_image(p)
    failing = _failing_pods(p)
    _judge(p, failing)
    if outcome(p.status) is None:
        _handle_failures(p, failing)
    p.stop_reason = _teardown_reason(p)


def _keep_running(p: _Pass) -> None:
    """A running job: create what is missing, move the phase on, and judge a job that has just become Running
    (its stall clock starts with it)."""
    _create_missing(p)
    _update_phase(p)
    if p.was_phase != Phase.RUNNING and p.status.phase == Phase.RUNNING:
        _judge(p, [])


def _stop(p: _Pass) -> None:
    """The ordered teardown, and the phase it leads to: Suspended; the outcome once everything is released;
    else Draining. A stopped job is not stalled (unless the stall is what failed it)."""
    st = p.status
    assert p.stop_reason is not None
    p.released = _run_teardown(p, p.stop_reason)
    _count_deleted_as_stopping(p)
    decided = outcome(st)
    if p.stop_reason == Reason.SUSPENDED:
        _suspend_phase(p)
    elif decided and p.released:
        cond = get(st.conditions, ConditionType(decided))
        _set_phase(p, decided, cond.reason if cond else decided, cond.message if cond else "", note=p.released_note)
        st.completion_time = st.completion_time or fmt_time(p.now)
    else:
        cond = get(st.conditions, ConditionType(decided)) if decided else None
        if cond is not None:
            _set_phase(p, Phase.DRAINING, cond.reason, cond.message)
        else:
            _set_phase(p, Phase.DRAINING, Reason.DELETED, "the TrainingJob is being deleted")
    if is_true(st.conditions, ConditionType.STALLED) and decided != Phase.FAILED:
        p.condition(ConditionType.STALLED, "False", Reason.NOT_RUNNING, event=False)


def _suspend_phase(p: _Pass) -> None:
    """Suspended while the ordered stop runs (Suspending), and Suspended=True once every component is stopped."""
    if not p.released:
        _set_phase(p, Phase.SUSPENDED, Reason.SUSPENDING, "ordered stop in progress")
        return
    why = p.gate.reason if p.gate.hold else Reason.SUSPENDED
    stopped = f"all components stopped: {p.gate.message}" if p.gate.hold else "all components stopped"
    p.condition(ConditionType.SUSPENDED, "True", why, stopped)
    _set_phase(p, Phase.SUSPENDED, why, _suspend_cause(p))


def _watch_event_source(p: _Pass) -> None:
    """Read the job's events while its Redis is up (not yet torn down, not suspended); EventSourceReachable says
    how that goes, and False once the Redis is released."""
    st = p.status
    p.watching = (
        p.spec is not None
        and (st.teardown is None or not any(s.name == "redis" for s in st.teardown.stages))
        and not (p.stop_reason == Reason.SUSPENDED and p.released)
    )
    if p.watching:
        _update_event_source(p)
    elif get(st.conditions, ConditionType.EVENT_SOURCE_REACHABLE) is not None:
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, "False", Reason.REDIS_RELEASED, "the job's Redis is torn down",
                    event=False)


def _release_kueue_workload(p: _Pass) -> None:
    """Tell Kueue what became of an admitted job (its Workload Finished, or its quota released on a suspend)."""
    st = p.status
    p.actions += kueue.release_actions(p.obs.kueue, st.phase, p.released, st.message or "", p.now)


def _expire_ttl(p: _Pass) -> None:
    """runPolicy.ttlSecondsAfterFinished: delete a finished job once it has run out, else look again then."""
    st = p.status
    if st.phase not in Phase.TERMINAL or p.ttl is None or p.job.deleting:
        return
    expires = (parse_time(st.completion_time) or p.now) + timedelta(seconds=p.ttl)
    if p.now >= expires:
        p.actions.append(DeleteJob())
        p.event("Normal", Reason.TTL_EXPIRED, f"deleting the job {p.ttl}s after it finished")
    else:
        p.wake_at(expires)


def _decision(p: _Pass) -> Decision:
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
