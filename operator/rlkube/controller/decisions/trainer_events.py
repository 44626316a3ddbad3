"""The trainer's event stream in the status: each new event folded in once (read by lifecycle/progress.py), the
trackers the trainer could not log to (condition TrackerFailed), and whether the stream can be read at all
(condition EventSourceReachable).
"""

from __future__ import annotations

from rlkube.api.role import Backend
from rlkube.api.status import AgentStatus, CheckpointRef, Completion
from rlkube.controller.decisions.conditions import get
from rlkube.controller.decisions.pass_state import Pass, outcome
from rlkube.controller.decisions.times import fmt_time, stream_id_key
from rlkube.controller.manifests import fastllm
from rlkube.lifecycle import progress, tracker_failures
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, EventType, Reason


def ingest_events(p: Pass) -> None:
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
            report_tracker_failure(p, *facts.tracker_failure)
        if facts.finished and outcome(p.status) is None:
            final_step = facts.step if facts.step is not None else tr.step
            checkpoint = facts.checkpoint[1] if facts.checkpoint else None
            if facts.step is None and not facts.interrupted and p.spec is not None and (
                    p.spec.trainer.backend == Backend.FAST_LLM):
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


def report_tracker_failure(p: Pass, tracker: str, message: str) -> None:
    """A tracker the trainer could not log to (spec.tracking): condition TrackerFailed and a Warning Event, once per
    tracker (lifecycle/tracker_failures.py); the job goes on."""
    current = get(p.status.conditions, tracker_failures.CONDITION)
    text = tracker_failures.merged(current.message if current else None, tracker, message)
    if text is None:
        return
    p.condition(tracker_failures.CONDITION, ConditionStatus.TRUE, tracker_failures.REASON, text, event=False)
    p.event(EventType.WARNING, tracker_failures.REASON, f"{tracker_failures.line(tracker, message)} (training goes on)")


def _condition_status(p: Pass, type_: str) -> str | None:
    return next((c.status for c in p.status.conditions if c.type == type_), None)


def update_event_source(p: Pass) -> None:
    src = p.obs.event_source
    if src.state == "Reachable":
        # An Event only for a recovery: the first connection is routine (the condition records it).
        was = _condition_status(p, ConditionType.EVENT_SOURCE_REACHABLE)
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, ConditionStatus.TRUE, Reason.CONNECTED, src.message,
                    event=was == ConditionStatus.FALSE)
    elif src.state == "Unreachable":
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, ConditionStatus.FALSE, src.reason, src.message)
    else:
        p.condition(ConditionType.EVENT_SOURCE_REACHABLE, ConditionStatus.UNKNOWN, src.reason, src.message,
                    event=False)
