"""Trainer events as the operator reads them from Redis, and one operator pass over a Running job that has read
them: the unit tests that check the operator and `rlkube local` read the same events alike start from here. Also
the next weights_ready on a real events stream, which the weight-transfer tests wait for."""

from __future__ import annotations

import time
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


def next_weights_ready(client, keys: protocol.StreamKeys, last_id: str, timeout: float) -> tuple[str, dict]:
    """(stream id, payload) of the next weights_ready after `last_id` on the job's events stream (a redis-py
    client), read until `timeout` seconds have passed; other events are stepped over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in client.xread({keys.events: last_id}, block=200) or []:
            for sid, fields in entries:
                last_id = sid.decode()
                event = protocol.decode_event(sid, fields)
                if event and event.type == protocol.WEIGHTS_READY:
                    return last_id, event.payload
    raise TimeoutError(f"no weights_ready after {last_id} within {timeout}s")
