"""One reconcile pass as a pure function: (job, observed pods and trainer events, time) -> actions + new status.

This is the operator's behaviour, all of it (design.md s4), kept free of I/O so every transition has a
table-driven unit test:

    Pending -> Starting -> Running -> Draining -> Succeeded | Failed        (and Suspended)

- Start-up is readiness-gated: ConfigMap/Secret/Services/Redis first; trainer and inference pods once Redis
  is Ready (together: the trainer never waits for inference); the preprocessor once they exist; actors once
  every inference server is Ready. Gates apply only before Running; later a missing pod is recreated at once.
- Outcome (decided once, never changed; conditions Succeeded/Failed carry the reason):
  training_finished AND trainer exit 0 -> Succeeded, unless the event stopped short of maxSteps (or says
  `interrupted`) -> Failed/TrainingInterrupted. Event without exit for completionTimeoutSeconds -> the trainer
  is stopped and the job succeeds only with the final step and a checkpoint (else TrainerDidNotExit).
  Exit 0 without event for completionTimeoutSeconds -> Failed/TrainerExitedWithoutFinishedEvent.
  Trainer failures beyond backoffLimit -> Failed/BackoffLimitExceeded. No trainer event for
  eventTimeoutSeconds while Running -> Stalled=True, and Failed/Stalled if runPolicy.failOnStall.
  A spec the schema could not reject -> Failed/InvalidSpec, nothing created. A child the API server rejects as
  invalid (400/422: a value the CRD schema let through, e.g. an image with trailing whitespace) ->
  Failed/InvalidSpec with the API server's message; nothing more is created, the rest is torn down.
- Spec changes while the job runs are not applied (pods are not rolled): the job keeps deciding by the spec it
  started with (status.startedSpec); only runPolicy.suspend is live. A change is reported once per distinct set
  of changed paths: a Warning Event and the condition SpecChangeIgnored. A resume starts from the new spec.
- A ConfigMap, Secret or Service deleted by hand is recreated by the next pass (Warning Event ChildRecreated)
  while the job runs; never once the outcome is decided or a teardown runs.
- Failures below the limit: a Failed pod (restartPolicy Never, or evicted) is replaced: deleted, then
  recreated by the next pass (trainer: resumes from its checkpoint volume); OnFailure restarts happen in
  place and count through restartCount. Producers and inference that end before training_finished are
  replaced too; the job continues.
- Once the outcome is decided (or the job is deleted or suspended), nothing is created again and the
  ordered teardown (teardown.py) runs; the phase becomes Succeeded/Failed/Suspended when it is done
  (ResourcesReleased=True).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from rlkube.api.spec import ROLES, GracePeriods, TrainingJobSpec
from rlkube.api.status import (
    CheckpointRef,
    Completion,
    ComponentStatus,
    TeardownStatus,
    TrainingJobStatus,
)
from rlkube.api.validation import SpecError, parse_spec
from rlkube.controller import builders, names, specdiff, teardown
from rlkube.controller.actions import (
    Action,
    Create,
    DeleteJob,
    DeleteObject,
    DeletePod,
    Event,
)
from rlkube.controller.conditions import (
    ROLE_CONDITIONS,
    get,
    is_true,
    remove,
    set_condition,
)
from rlkube.controller.observed import Observed, PodView
from rlkube.controller.times import fmt_time, parse_time, stream_id_key, stream_id_time
from rlkube.core import protocol

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


def outcome(status: TrainingJobStatus) -> str | None:
    """The decided outcome, "Succeeded" or "Failed", or None while undecided."""
    for kind in ("Succeeded", "Failed"):
        if is_true(status.conditions, kind):
            return kind
    return None


class _Pass:
    """Mutable scratch state of one decision; `decide` orchestrates the steps below."""

    def __init__(self, job: JobView, obs: Observed, now: datetime, password: str):
        self.job = job
        self.spec = job.spec
        self.obs = obs
        self.now = now
        self.password = password
        self.status = job.status.model_copy(deep=True)
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.deadline: datetime | None = None
        self.replaced_now: set[str] = set()
        self.trainer_failed_now = False
        self.teardown_seconds: float | None = None
        self.fresh = job.status.start_time is None
        """This pass creates the children for the first time (a new job, or a resume): nothing is "recreated"."""

    # -- helpers ------------------------------------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def condition(self, type_: str, status: str, reason: str, message: str = "", event: bool = True) -> None:
        changed = set_condition(self.status.conditions, type_, status, reason, message, self.now, self.job.generation)
        if changed and event:
            bad = (status == "True" and type_ in ("Failed", "Stalled")) or (
                status == "False" and type_ == "EventSourceReachable"
            )
            self.event("Warning" if bad else "Normal", reason, f"{type_}={status}: {message}".rstrip(": "))

    def wake_at(self, when: datetime) -> None:
        if self.deadline is None or when < self.deadline:
            self.deadline = when

    def live(self, role: str) -> list[PodView]:
        return [p for p in self.obs.role_pods(role) if not p.deleting]

    def rank0(self) -> PodView | None:
        return next((p for p in self.live("trainer") if p.index == 0), None)

    def decide_outcome(self, kind: str, reason: str, message: str) -> None:
        if outcome(self.status) is not None:
            return
        self.condition(kind, "True", reason, message)
        self.status.reason = reason
        self.status.message = message

    @property
    def max_steps(self) -> int:
        return self.spec.algorithm.max_steps if self.spec else 0


# -- trainer events -----------------------------------------------------------------------------------


def _ingest_events(p: _Pass) -> None:
    tr = p.status.trainer
    for ev in p.obs.events:
        if stream_id_key(ev.stream_id) <= stream_id_key(tr.last_event_id):
            continue  # already accounted for (a re-read after an operator restart)
        payload = ev.payload
        step = ev.step
        if ev.type == protocol.WEIGHTS_READY:
            if step is not None:
                tr.step = step
                version = payload.get("version", step)
                tr.weights_version = int(version) if isinstance(version, int | float) else step
            seen = payload.get("documents_seen")
            if isinstance(seen, int | float):
                tr.documents_seen = int(seen)
        elif ev.type == protocol.METRICS:
            if step is not None:
                tr.step = step
            lag = payload.get("lag_max", payload.get("lag"))  # our trainer reports the step's worst lag
            if isinstance(lag, int | float):
                p.status.lag = int(lag)
        elif ev.type == protocol.CHECKPOINT_SAVED:
            path = payload.get("path") or payload.get("checkpoint")
            if step is not None and isinstance(path, str):
                tr.last_checkpoint = CheckpointRef(step=step, path=path)
        elif ev.type == protocol.TRAINING_FINISHED and outcome(p.status) is None:
            final_step = step if step is not None else tr.step
            checkpoint = payload.get("checkpoint")
            if step is not None:
                tr.step = step
            if isinstance(checkpoint, str) and step is not None:
                tr.last_checkpoint = CheckpointRef(step=step, path=checkpoint)
            previous = p.status.completion or Completion()
            p.status.completion = previous.model_copy(
                update={
                    "stream_id": ev.stream_id,
                    "event_time": fmt_time(p.now),
                    "final_step": final_step,
                    "checkpoint": checkpoint if isinstance(checkpoint, str) else None,
                    "interrupted": bool(payload.get("interrupted")) or final_step < p.max_steps,
                }
            )
            p.event("Normal", "TrainingFinishedEvent", f"training_finished at step {final_step} ({ev.stream_id})")
        tr.last_event_id = ev.stream_id
        tr.last_event_time = fmt_time(p.now)
    if p.obs.read_upto and stream_id_key(p.obs.read_upto) > stream_id_key(tr.last_event_id):
        tr.last_event_id = p.obs.read_upto  # only malformed/unknown entries beyond the last event: skip them
    if p.spec is not None:
        tr.max_steps = p.spec.algorithm.max_steps
        p.status.progress = f"{tr.step}/{tr.max_steps}"


# -- components: counts, restarts, readiness ------------------------------------------------------


def _restarts(p: _Pass, role: str, comp: ComponentStatus) -> int:
    return comp.restarts_of_replaced_pods + sum(
        pod.restart_count for pod in p.obs.role_pods(role) if pod.uid not in comp.replaced_pods
    )


def _update_components(p: _Pass, stopping: bool) -> None:
    spec = p.spec
    for role in ROLES:
        desired = builders.replicas(spec, role) if spec else 0
        comp = p.status.components.get(role) or ComponentStatus()
        comp = comp.model_copy(deep=True)
        comp.desired = desired
        live = p.live(role)
        comp.ready = sum(1 for pod in live if pod.ready and pod.phase == "Running")
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
            p.condition(ctype, "False", "Stopped", f"{left} pod(s) left" if left else "", event=False)
        elif desired == 0:
            # External Redis: ready means the operator can read the job's events from it.
            reachable = p.obs.event_source.state == "Reachable"
            p.condition(ctype, "True" if reachable else "False", "External", "external Redis (spec.redis.url)")
        elif comp.ready >= desired:
            p.condition(ctype, "True", "AllReady", f"{comp.ready}/{desired} ready")
        else:
            waiting = sorted({pod.waiting_reason for pod in live if pod.waiting_reason})
            detail = f"; waiting: {', '.join(waiting)}" if waiting else ""
            p.condition(ctype, "False", "NotReady", f"{comp.ready}/{desired} ready{detail}", event=False)
    p.status.trainer_restarts = p.status.components["trainer"].restarts


def _replace(p: _Pass, pod: PodView, why: str) -> None:
    """Delete a pod that ended too early, counting it once; the creation path brings a fresh one."""
    comp = p.status.components[pod.role]
    comp.restarts_of_replaced_pods += pod.restart_count + 1
    comp.replaced_pods = (comp.replaced_pods + [pod.uid])[-REPLACED_MEMORY:]
    comp.restarts = _restarts(p, pod.role, comp)
    p.replaced_now.add(pod.uid)
    p.actions.append(DeletePod(pod.name, pod.uid, 0, pod.role))
    reason = "TrainerRestarted" if pod.role == "trainer" else "ComponentRestarted"
    p.event("Warning", reason, f"pod {pod.name} {why}; replacing it")


def _handle_failures(p: _Pass) -> None:
    """Replace failed pods; fail the job when the trainer has failed more than backoffLimit times."""
    spec = p.spec
    assert spec is not None
    backoff = spec.run_policy.backoff_limit
    previous = p.job.status.components.get("trainer")
    before = previous.restarts if previous else 0
    finished_event = p.status.completion is not None and p.status.completion.stream_id is not None
    for role in ROLES:
        comp = p.status.components[role]
        for pod in p.live(role):
            if pod.uid in comp.replaced_pods:
                continue
            code = f"exit code {pod.exit_code}" if pod.exit_code is not None else pod.phase
            if role == "trainer":
                if pod.phase != "Failed":
                    continue
                if comp.restarts + 1 > backoff:
                    p.decide_outcome(
                        "Failed",
                        "BackoffLimitExceeded",
                        f"trainer pod {pod.name} failed ({code}) after {comp.restarts} restart(s); "
                        f"backoffLimit is {backoff}",
                    )
                    return
                ckpt = p.status.trainer.last_checkpoint
                resume = f", resuming from checkpoint step {ckpt.step}" if ckpt else ""
                _replace(p, pod, f"failed ({code}), restart {comp.restarts + 1} of {backoff}{resume}")
            elif pod.phase == "Failed":
                _replace(p, pod, f"ended ({code}) before training finished")
            elif pod.phase == "Succeeded" and not finished_event:
                # A producer stops by itself on training_finished: exit 0 is a failure only if that event is
                # really not in the stream, not merely unread yet (operator restart, a watcher that lags).
                # Only a read to the stream's end made after this pod was seen ended proves that; without one
                # (Redis unreachable) wait and look again.
                if p.obs.events_read_to_end:
                    _replace(p, pod, f"ended ({code}) before training finished")
                else:
                    p.wake_at(p.now + timedelta(seconds=UNREAD_RECHECK_SECONDS))
    trainer = p.status.components["trainer"]
    p.status.trainer_restarts = trainer.restarts
    if trainer.restarts > before:
        p.trainer_failed_now = True
        in_place = trainer.restarts - before - sum(1 for uid in p.replaced_now if uid in trainer.replaced_pods)
        if in_place > 0:
            p.event("Warning", "TrainerRestarted", f"trainer restarted in place ({trainer.restarts} restart(s) so far)")
        if trainer.restarts > backoff:
            p.decide_outcome(
                "Failed",
                "BackoffLimitExceeded",
                f"trainer restarted {trainer.restarts} time(s); backoffLimit is {backoff}",
            )


# -- completion ---------------------------------------------------------------------------------------


def _apply_completion_rules(p: _Pass) -> None:
    spec = p.spec
    assert spec is not None
    timeout = timedelta(seconds=spec.run_policy.completion_timeout_seconds)
    comp = p.status.completion
    rank0 = p.rank0()

    if comp is not None and comp.stream_id is not None:
        # A training_finished from a trainer incarnation that has since been restarted is no evidence.
        stale = p.trainer_failed_now or (
            rank0 is not None and rank0.started_at is not None and stream_id_time(comp.stream_id) < rank0.started_at
        )
        if stale:
            p.event("Warning", "StaleFinishedEvent", f"ignoring training_finished {comp.stream_id}: trainer restarted")
            comp = p.status.completion = None

    if rank0 is not None and rank0.phase == "Succeeded" and (comp is None or comp.trainer_exit_code is None):
        comp = p.status.completion = (comp or Completion()).model_copy(
            update={"trainer_exit_code": 0, "trainer_exit_time": fmt_time(p.now)}
        )
        p.event("Normal", "TrainerExited", f"trainer pod {rank0.name} exited 0")
    if comp is None:
        return

    has_event = comp.stream_id is not None
    exited = comp.trainer_exit_code == 0
    full = has_event and not comp.interrupted and (comp.final_step or 0) >= p.max_steps
    if has_event and exited:
        if full:
            p.decide_outcome("Succeeded", "TrainingFinished", f"trained {comp.final_step}/{p.max_steps} steps")
        else:
            p.decide_outcome(
                "Failed",
                "TrainingInterrupted",
                f"training_finished at step {comp.final_step} of {p.max_steps} (interrupted or scheduled stop)",
            )
    elif has_event:
        deadline = (parse_time(comp.event_time) or p.now) + timeout
        if p.now < deadline:
            p.wake_at(deadline)
        elif full and comp.checkpoint:
            p.decide_outcome(
                "Succeeded",
                "TrainingFinished",
                f"trained {comp.final_step}/{p.max_steps} steps, checkpoint {comp.checkpoint}; the trainer did not "
                f"exit within completionTimeoutSeconds ({timeout.seconds}s) and is stopped",
            )
        else:
            p.decide_outcome(
                "Failed",
                "TrainerDidNotExit",
                f"training_finished (step {comp.final_step}, checkpoint {comp.checkpoint}) but the trainer did not "
                f"exit within {timeout.seconds}s, and the event lacks the final step or a checkpoint",
            )
    elif exited:
        deadline = (parse_time(comp.trainer_exit_time) or p.now) + timeout
        if p.now < deadline:
            p.wake_at(deadline)
        else:
            p.decide_outcome(
                "Failed",
                "TrainerExitedWithoutFinishedEvent",
                f"trainer exited 0 but published no training_finished within {timeout.seconds}s",
            )


def _check_stall(p: _Pass) -> None:
    spec = p.spec
    assert spec is not None
    limit = spec.run_policy.event_timeout_seconds
    pending = p.status.completion is not None and p.status.completion.stream_id is not None
    if p.status.phase != "Running" or not limit or pending:
        if is_true(p.status.conditions, "Stalled"):
            p.condition("Stalled", "False", "NotRunning")
        return
    rank0 = p.rank0()
    refs = [parse_time(p.status.trainer.last_event_time), parse_time(p.status.running_since)]
    refs.append(rank0.started_at if rank0 else None)
    ref = max((r for r in refs if r is not None), default=p.now)
    deadline = ref + timedelta(seconds=limit)
    if p.now < deadline:
        was_stalled = is_true(p.status.conditions, "Stalled")
        p.condition("Stalled", "False", "EventsResumed" if was_stalled else "Progressing", event=was_stalled)
        p.wake_at(deadline)
        return
    message = f"no trainer event for {limit}s (last at {p.status.trainer.last_event_time or 'never'})"
    p.condition("Stalled", "True", "NoTrainerEvents", message)
    if spec.run_policy.fail_on_stall:
        p.decide_outcome("Failed", "Stalled", message)


def _update_event_source(p: _Pass, watching: bool) -> None:
    if not watching:
        return
    src = p.obs.event_source
    if src.state == "Reachable":
        p.condition("EventSourceReachable", "True", "Connected", src.message)
    elif src.state == "Unreachable":
        p.condition("EventSourceReachable", "False", src.reason, src.message)
    else:
        p.condition("EventSourceReachable", "Unknown", src.reason, src.message, event=False)


# -- creation -------------------------------------------------------------------------------------


def _create_missing(p: _Pass) -> None:
    job = p.job.ref
    if any(f"{kind}/{name}" not in p.obs.static_present for kind, name in _static_names(p)):
        for manifest in builders.static_children(job, p.password):
            kind, name = manifest["kind"], manifest["metadata"]["name"]
            if f"{kind}/{name}" not in p.obs.static_present:
                p.actions.append(Create(manifest))
                if not p.fresh:
                    p.event("Warning", "ChildRecreated", f"{kind} {name} was missing (deleted by hand?); recreated it")
    present = {pod.name for pod in p.obs.pods}
    gated = p.status.phase in ("Pending", "Starting")
    comps = p.status.components

    def all_exist(role: str) -> bool:
        return all(n in present for n in builders.pod_names(job, role))

    redis_ready = not job.managed_redis or comps["redis"].ready >= 1
    allowed = {
        "redis": lambda: True,
        "trainer": lambda: redis_ready,
        "inference": lambda: redis_ready,
        "preprocessor": lambda: redis_ready and all_exist("trainer") and all_exist("inference"),
        "actor": lambda: comps["inference"].ready >= comps["inference"].desired,
    }
    ckpt = p.status.trainer.last_checkpoint
    for role in names.POD_ROLES:  # start order: each gate sees what this pass already created
        if gated and not allowed[role]():
            continue
        for i in range(builders.replicas(job.spec, role)):
            if names.pod_name(job.name, role, i) in present:
                continue
            resume = ckpt.path if (role == "trainer" and ckpt) else None
            p.actions.append(Create(builders.pod(job, role, i, resume_checkpoint=resume)))
            present.add(names.pod_name(job.name, role, i))  # a later gate may only need it to exist


def _update_phase(p: _Pass) -> None:
    st = p.status
    if st.phase in ("Pending", "Starting"):
        anything_running = any(pod.running for pod in p.obs.pods)
        all_ready = all(c.ready >= c.desired for c in st.components.values())
        if all_ready or st.trainer.last_event_id is not None:
            _set_phase(p, "Running", "AllComponentsReady" if all_ready else "TrainerReporting")
            st.running_since = fmt_time(p.now)
        elif anything_running:
            _set_phase(p, "Starting", "ComponentsStarting", "waiting for every component to be Ready")
        else:
            _set_phase(p, "Pending", "PodsPending", "children created, no pod running yet")


def _set_phase(p: _Pass, phase: str, reason: str, message: str = "") -> None:
    st = p.status
    if st.phase != phase:
        p.event("Warning" if phase == "Failed" else "Normal", phase, f"{st.phase} -> {phase}: {reason} {message}".strip())
    st.phase = phase  # type: ignore[assignment]
    st.reason = reason
    st.message = message


# -- teardown -------------------------------------------------------------------------------------


def _teardown_reason(p: _Pass) -> str | None:
    """Why the job must be torn down now, or None while it should run."""
    td = p.status.teardown
    decided = outcome(p.status)
    if decided:
        return decided if td is None or td.reason in (None, "Suspended") else td.reason
    if td is not None and td.reason in ("Deleted", "Suspended") and td.stage != teardown.DONE:
        return td.reason  # an ordered stop in progress is finished first
    if p.job.deleting:
        return "Deleted"
    if p.spec is not None and p.spec.run_policy.suspend:
        return "Suspended"
    return None


def _run_teardown(p: _Pass, reason: str) -> bool:
    st = p.status
    td = st.teardown
    if td is None or td.reason != reason and td.stage == teardown.DONE:
        # A new teardown (a finished suspend followed by deletion or an outcome restarts the sequence).
        td = TeardownStatus(reason=reason)
        p.condition("ResourcesReleased", "False", "TearingDown", f"ordered teardown ({reason})")
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
        last = f": {teardown.describe(step.finished_stages[-1])}" if step.finished_stages else ""
        p.condition("ResourcesReleased", "True", "AllPodsGone", f"teardown ({reason}) finished{last}")
    return step.done


def _static_names(p: _Pass) -> list[tuple[str, str]]:
    job = p.job.name
    out = [("ConfigMap", names.config_name(job))]
    managed = p.spec is None or p.spec.redis.mode == "managed"
    if managed:
        out.append(("Secret", names.secret_name(job)))
    out += [("Service", names.service_name(job, r)) for r in names.SERVICE_ROLES if r != "redis" or managed]
    return out


def _can_resume(job: JobView) -> bool:
    st = job.status
    return (
        st.phase == "Suspended"
        and st.teardown is not None
        and st.teardown.stage == teardown.DONE
        and job.spec is not None
        and not job.spec.run_policy.suspend
        and not job.deleting
    )


def _as_started(live: JobView) -> JobView:
    """The job as its pods run it: the spec it started with, runPolicy.suspend (and deletion) as they are now."""
    started = live.status.started_spec
    if started is None:
        return live
    raw = specdiff.with_live_fields(started, live.raw_spec)
    try:
        spec = parse_spec(raw)
    except SpecError:
        return live  # recorded by an operator whose schema differed: act on the current spec
    return replace(live, raw_spec=raw, spec=spec, spec_error=None)


def _report_spec_changes(p: _Pass, live: JobView) -> None:
    """One Warning Event per distinct set of ignored changes; the condition says which while they last."""
    st = p.status
    suspending = bool((live.raw_spec.get("runPolicy") or {}).get("suspend"))
    if st.started_spec is None or st.phase not in ("Pending", "Starting", "Running", "Draining") or live.deleting:
        return
    if suspending:
        return  # the change is applied when the job resumes: nothing is ignored
    paths = specdiff.changed_paths(st.started_spec, live.raw_spec)
    previous = get(st.conditions, "SpecChangeIgnored")
    if paths:
        message = (
            f"{specdiff.describe(paths)} changed after the job started (generation {st.started_generation} -> "
            f"{live.generation}); not applied to the running job (suspend and resume it to apply)"
        )
        # The generations in the message change with every edit; the Event only when the paths do.
        if previous is None or previous.status != "True" or not previous.message.startswith(specdiff.describe(paths) + " "):
            p.event("Warning", "SpecChangeIgnored", message)
        p.condition("SpecChangeIgnored", "True", "SpecChangeIgnored", message, event=False)
    elif previous is not None and previous.status == "True":
        p.condition("SpecChangeIgnored", "False", "SpecAsStarted", "the spec is back to the one the job started with",
                    event=False)


def _resume_from_suspend(p: _Pass) -> None:
    st = p.status
    st.teardown = None
    st.completion = None
    st.running_since = None
    st.trainer.last_event_id = None  # the next Redis (and its streams) is a new one
    remove(st.conditions, "ResourcesReleased")
    remove(st.conditions, "Stalled")
    remove(st.conditions, "SpecChangeIgnored")
    p.fresh = True
    p.condition("Suspended", "False", "Resumed", "spec.runPolicy.suspend unset")
    _set_phase(p, "Pending", "Resumed", "recreating the components")


# -- the pass -------------------------------------------------------------------------------------


def decide(job: JobView, obs: Observed, now: datetime, password: str = "") -> Decision:
    """Decide one reconcile pass. `password` is only used if the managed Redis Secret must be created."""
    live = job
    resuming = _can_resume(live)
    job = live if resuming else _as_started(live)
    p = _Pass(job, obs, now, password)
    st = p.status
    st.observed_generation = job.generation
    if st.start_time is None:
        st.start_time = fmt_time(now)
        p.event("Normal", "Accepted", f"reconciling TrainingJob {job.namespace}/{job.name}")
    was_phase = st.phase

    if job.spec is None:
        p.decide_outcome("Failed", "InvalidSpec", job.spec_error or "invalid spec")

    # A finished suspend whose flag was cleared: start again from Pending, with the spec as it is now.
    if resuming:
        _resume_from_suspend(p)
    if job.spec is not None and (st.started_spec is None or resuming):
        st.started_spec = copy.deepcopy(job.raw_spec)
        st.started_generation = job.generation
    _report_spec_changes(p, live)

    if obs.create_rejected is not None:
        rej = obs.create_rejected
        p.decide_outcome("Failed", "InvalidSpec", f"the API server rejected {rej.kind} {rej.name}: {rej.message}")

    _ingest_events(p)
    reason = _teardown_reason(p)
    _update_components(p, stopping=reason is not None)

    if reason is None:
        _handle_failures(p)
        if outcome(st) is None:
            _apply_completion_rules(p)
        if outcome(st) is None:
            _check_stall(p)
        reason = _teardown_reason(p)

    released = False
    if reason is not None:
        released = _run_teardown(p, reason)
        decided = outcome(st)
        if reason == "Suspended":
            if released:
                p.condition("Suspended", "True", "Suspended", "all components stopped")
                _set_phase(p, "Suspended", "Suspended", "spec.runPolicy.suspend is set")
            else:
                _set_phase(p, "Suspended", "Suspending", "ordered stop in progress")
        elif decided and released:
            failed = get(st.conditions, decided)
            _set_phase(p, decided, failed.reason if failed else decided, failed.message if failed else "")
            st.completion_time = st.completion_time or fmt_time(now)
        else:
            cond = get(st.conditions, decided) if decided else None
            if cond is not None:
                _set_phase(p, "Draining", cond.reason, cond.message)
            else:
                _set_phase(p, "Draining", "Deleted", "the TrainingJob is being deleted")
        if is_true(st.conditions, "Stalled") and decided != "Failed":
            p.condition("Stalled", "False", "NotRunning", event=False)
    else:
        _create_missing(p)
        _update_phase(p)
        if was_phase != "Running" and st.phase == "Running":
            _check_stall(p)

    watching = (
        job.spec is not None
        and (st.teardown is None or not any(s.name == "redis" for s in st.teardown.stages))
        and not (reason == "Suspended" and released)
    )
    _update_event_source(p, watching)
    if not watching and get(st.conditions, "EventSourceReachable") is not None:
        p.condition("EventSourceReachable", "False", "RedisReleased", "the job's Redis is torn down", event=False)

    terminal = st.phase in ("Succeeded", "Failed")
    ttl = job.spec.run_policy.ttl_seconds_after_finished if job.spec else None
    if terminal and ttl is not None and not job.deleting:
        expires = (parse_time(st.completion_time) or now) + timedelta(seconds=ttl)
        if now >= expires:
            p.actions.append(DeleteJob())
            p.event("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished")
        else:
            p.wake_at(expires)

    decision = Decision(
        status=st,
        actions=p.actions,
        events=p.events,
        watch_events=watching,
        released=released,
        finished=terminal and released and (ttl is None or job.deleting),
        teardown_seconds=p.teardown_seconds,
    )
    if p.deadline is not None:
        decision.requeue_after = max(0.0, (p.deadline - now).total_seconds())
    return decision
