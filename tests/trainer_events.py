"""Trainer events as the operator reads them from Redis, and one operator pass over a Running job that has read
them: the unit tests that check the operator and `rlkube local` read the same events alike start from here."""

from __future__ import annotations

from datetime import datetime

from rlkube.api.status import ComponentStatus, TrainingJobStatus
from rlkube.contract import protocol
from rlkube.controller.decisions.recipe import Decision, JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed
from rlkube.controller.decisions.times import fmt_time
from rlkube.lifecycle.validation import parse_spec

ROLES = ("redis", "trainer", "inference", "preprocessor", "actor")


def event(t: datetime, type_: str, **payload) -> protocol.TrainerEvent:
    """An event of `type_` written at `t` (its stream id is the time in milliseconds)."""
    return protocol.TrainerEvent(f"{int(t.timestamp() * 1000)}-0", type_, {"type": type_, **payload})


def decide_running(raw: dict, events: tuple[protocol.TrainerEvent, ...], started: datetime,
                   now: datetime) -> Decision:
    """The operator's pass at `now` over job `j` (spec `raw`), Running since `started`, with every event read."""
    status = TrainingJobStatus(phase="Running", start_time=fmt_time(started), running_since=fmt_time(started),
                               started_spec=raw, started_generation=1)
    for role in ROLES:
        status.components[role] = ComponentStatus(desired=1, ready=0)
    return decide(JobView("ns", "j", "uid-j", 1, raw, parse_spec(raw), None, False, status),
                  Observed(events=events, event_source=EventSource("Reachable", "Connected", "", caught_up=True),
                           events_read_to_end=True), now)
