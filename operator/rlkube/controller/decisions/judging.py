"""A running job judged in the pass: the pods that ended too early, the evidence the lifecycle's judgement reads
(lifecycle/judgement.py; docs/design.md §4.1-§4.3), its outcome and the Stalled condition, the pods replaced while
every budget is open, and an image that cannot be pulled (§2.4).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from rlkube.api.role import Role
from rlkube.api.status import Completion
from rlkube.contract import runtime
from rlkube.controller.decisions import image_pull
from rlkube.controller.decisions.components import replace_pod
from rlkube.controller.decisions.conditions import is_true
from rlkube.controller.decisions.observed import PodView
from rlkube.controller.decisions.pass_state import Pass
from rlkube.controller.decisions.times import fmt_time, parse_time, stream_id_time
from rlkube.lifecycle import roles
from rlkube.lifecycle.evidence import Evidence, Failure, Finished
from rlkube.lifecycle.judgement import judge
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, EventType, Phase, PodPhase, Reason

UNREAD_RECHECK_SECONDS = 2.0
"""How soon a pass looks again at a producer that exited 0 while the event stream could not be read to its end."""


def failing_pods(p: Pass) -> list[tuple[PodView, str]]:
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
                out.append((pod, f"failed ({code})" if role == Role.TRAINER
                            else f"ended ({code}) before training finished"))
            elif role != Role.TRAINER and pod.phase == PodPhase.SUCCEEDED and not finished_event:
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


def _evidence(p: Pass, failing: list[tuple[PodView, str]]) -> Evidence:
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
    previous = p.job.status.components.get(Role.TRAINER)
    p.trainer_failed_now = restarts.get(Role.TRAINER, 0) > (previous.restarts if previous else 0)
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
            p.event(EventType.WARNING, Reason.STALE_FINISHED_EVENT,
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


def apply_judgement(p: Pass, failing: list[tuple[PodView, str]]) -> None:
    """Apply the lifecycle's judgement: an outcome, the Stalled condition, and when to look again."""
    verdict = judge(_evidence(p, failing), p.spec)
    if verdict.wake_at is not None:
        p.wake_at(verdict.wake_at)
    if verdict.stalled is None:
        if is_true(p.status.conditions, ConditionType.STALLED):
            p.condition(ConditionType.STALLED, ConditionStatus.FALSE, Reason.NOT_RUNNING)
    elif verdict.stalled:
        p.condition(ConditionType.STALLED, ConditionStatus.TRUE, Reason.NO_TRAINER_EVENTS, verdict.stall_message)
    else:
        was = is_true(p.status.conditions, ConditionType.STALLED)
        p.condition(ConditionType.STALLED, ConditionStatus.FALSE, Reason.EVENTS_RESUMED if was else Reason.PROGRESSING,
                    event=was)
    if verdict.outcome is not None:
        o = verdict.outcome
        p.decide_outcome(o.phase, o.reason, o.message)


def handle_failures(p: Pass, failing: list[tuple[PodView, str]]) -> None:
    """Replace the pods that ended too early (the judgement found every budget still open)."""
    backoff = p.spec.run_policy.backoff_limit
    before = p.status.components[Role.TRAINER].restarts
    for pod, why in failing:
        if pod.role == Role.TRAINER:
            n = p.status.components[Role.TRAINER].restarts + 1
            ckpt = p.status.trainer.last_checkpoint
            resume = f", resuming from checkpoint step {ckpt.step}" if ckpt else ""
            why = f"{why}, restart {n} of {backoff}{resume}"
        replace_pod(p, pod, why)
    trainer = p.status.components[Role.TRAINER]
    p.status.trainer_restarts = trainer.restarts
    previous = p.job.status.components.get(Role.TRAINER)
    in_place = before - (previous.restarts if previous else 0)
    if in_place > 0:
        p.event(EventType.WARNING, Reason.TRAINER_RESTARTED,
                f"trainer restarted in place ({trainer.restarts} restart(s) so far)")


def fail_unpullable_image(p: Pass) -> None:
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
