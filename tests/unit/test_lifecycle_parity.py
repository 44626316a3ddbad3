"""The same evidence, judged by the operator and by `rlkube local`, gets the same verdict.

Each row describes a moment of a job in launcher-neutral terms (trainer failures so far and now, the finished
event and its age, the trainer's exit and its age, how long the trainer has been silent, an invalid spec). The
operator side turns it into a status + pods and runs `decisions.decide`; the local side into a `LocalJob` with
real (already exited) processes and runs its judgement. Both must agree on the outcome, or on "no outcome yet".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from rich.console import Console
from rlkube.api.status import Completion, ComponentStatus, TrainingJobStatus
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.decisions.recipe import JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed, PodView
from rlkube.controller.decisions.times import fmt_time
from rlkube.contract import protocol
from rlkube.lifecycle.phases import Phase
from rlkube.local.processes import RoleProcess
from rlkube.local.runner import LocalJob, run_local
from support import specs

EXAMPLE = specs.document()
MAX_STEPS = EXAMPLE["spec"]["algorithm"]["maxSteps"]
TIMEOUT = 60  # completionTimeoutSeconds
STALL = 300  # eventTimeoutSeconds


@dataclass(frozen=True)
class Row:
    failures_before: int = 0
    """Trainer restarts already counted."""
    trainer_fails_now: bool = False
    finished: tuple[int, str | None, bool, float] | None = None
    """training_finished: (step, checkpoint, interrupted, seconds since it was read)."""
    exited_ago: float | None = None
    """Trainer rank 0 exited 0 this many seconds ago."""
    idle: float = 5.0
    """Seconds since the last trainer event (the job is Running)."""
    spec: dict = field(default_factory=dict)
    """runPolicy overrides (or other spec paths)."""


ROWS = {
    "running": (Row(), None),
    "backoff: failure within the limit restarts": (Row(failures_before=1, trainer_fails_now=True,
                                                       spec={"runPolicy.backoffLimit": 2}), None),
    "backoff: failure at the boundary restarts": (Row(failures_before=1, trainer_fails_now=True,
                                                      spec={"runPolicy.backoffLimit": 2}), None),
    "backoff: one failure past the limit fails": (Row(failures_before=2, trainer_fails_now=True,
                                                      spec={"runPolicy.backoffLimit": 2}),
                                                  (Phase.FAILED, "BackoffLimitExceeded")),
    "backoff: limit 0 fails the first failure": (Row(trainer_fails_now=True, spec={"runPolicy.backoffLimit": 0}),
                                                 (Phase.FAILED, "BackoffLimitExceeded")),
    "stall without failOnStall is reported, not fatal": (Row(idle=STALL + 5), None),
    "stall with failOnStall fails": (Row(idle=STALL + 5, spec={"runPolicy.failOnStall": True}),
                                     (Phase.FAILED, "Stalled")),
    "quiet but within eventTimeoutSeconds": (Row(idle=STALL - 5, spec={"runPolicy.failOnStall": True}), None),
    "event and exit": (Row(finished=(MAX_STEPS, "/c/step-40", False, 1), exited_ago=0.5),
                       (Phase.SUCCEEDED, "TrainingFinished")),
    "event without exit, within the timeout": (Row(finished=(MAX_STEPS, "/c/step-40", False, 10)), None),
    "event without exit, final step and checkpoint": (Row(finished=(MAX_STEPS, "/c/step-40", False, TIMEOUT + 5)),
                                                      (Phase.SUCCEEDED, "TrainingFinished")),
    "event without exit, no checkpoint": (Row(finished=(MAX_STEPS, None, False, TIMEOUT + 5)),
                                          (Phase.FAILED, "TrainerDidNotExit")),
    "exit without event, within the timeout": (Row(exited_ago=10), None),
    "exit without event": (Row(exited_ago=TIMEOUT + 5), (Phase.FAILED, "TrainerExitedWithoutFinishedEvent")),
    "interrupted event": (Row(finished=(7, "/c/step-7", True, 1), exited_ago=0.5),
                          (Phase.FAILED, "TrainingInterrupted")),
    "event below maxSteps": (Row(finished=(7, "/c/step-7", False, 1), exited_ago=0.5),
                             (Phase.FAILED, "TrainingInterrupted")),
    "invalid spec": (Row(spec={"redis.mode": "external"}), (Phase.FAILED, "InvalidSpec")),
}


def raw_spec(row: Row) -> dict:
    return specs.spec(**{"runPolicy.completionTimeoutSeconds": TIMEOUT, "runPolicy.eventTimeoutSeconds": STALL,
                         **row.spec})


def last_event_at(row: Row, now: datetime) -> datetime:
    """The trainer's last event: `idle` ago, or the finished event itself if that is older."""
    idle = max(row.idle, row.finished[3]) if row.finished else row.idle
    return now - timedelta(seconds=idle)


def stream_id(t: datetime) -> str:
    return f"{int(t.timestamp() * 1000)}-0"


# -- the operator ---------------------------------------------------------------------------------------


def operator_verdict(row: Row, now: datetime) -> tuple[str, str] | None:
    raw = raw_spec(row)
    try:
        spec, error = parse_spec(raw), None
    except SpecError as exc:
        spec, error = None, str(exc)
    last_event = last_event_at(row, now)
    started = last_event - timedelta(seconds=10)
    status = TrainingJobStatus(phase="Running", start_time=fmt_time(started), running_since=fmt_time(started),
                               started_spec=raw, started_generation=1)
    status.trainer.last_event_time = fmt_time(last_event)
    status.trainer.last_event_id = stream_id(last_event)
    for role in ("redis", "trainer", "inference", "preprocessor", "actor"):
        restarts = row.failures_before if role == "trainer" else 0
        status.components[role] = ComponentStatus(desired=1, ready=1, restarts=restarts,
                                                  restarts_of_replaced_pods=restarts)
    if row.finished or row.exited_ago is not None:
        comp = Completion()
        if row.finished:
            step, ckpt, interrupted, ago = row.finished
            read = now - timedelta(seconds=ago)
            comp = comp.model_copy(update=dict(stream_id=stream_id(read), event_time=fmt_time(read), final_step=step,
                                               checkpoint=ckpt, interrupted=interrupted or step < MAX_STEPS))
        if row.exited_ago is not None:
            comp = comp.model_copy(update=dict(trainer_exit_code=0,
                                               trainer_exit_time=fmt_time(now - timedelta(seconds=row.exited_ago))))
        status.completion = comp
    pods = []
    for role in ("redis", "trainer", "inference", "preprocessor", "actor"):
        name = "j-redis" if role == "redis" else f"j-{role}-0"
        phase, code = "Running", None
        if role == "trainer" and row.trainer_fails_now:
            phase, code = "Failed", 1
        elif role == "trainer" and row.exited_ago is not None:
            phase, code = "Succeeded", 0
        pods.append(PodView(name=name, uid=f"uid-{name}", role=role, index=0, phase=phase, ready=phase == "Running",
                            exit_code=code, started_at=started, pod_ip="10.0.0.9"))
    static = {"ConfigMap/j-config", "Secret/j-redis", "Service/j-redis", "Service/j-inference", "Service/j-trainer"}
    obs = Observed(pods=tuple(pods), event_source=EventSource("Reachable", "Connected", "", caught_up=True),
                   events_read_to_end=True, static_present=frozenset(static))
    job = JobView("ns", "j", "uid-j", 1, raw, spec, error, False, status)
    d = decide(job, obs, now)
    for kind in (Phase.SUCCEEDED, Phase.FAILED):
        c = next((c for c in d.status.conditions if c.type == kind and c.status == "True"), None)
        if c is not None:
            return kind, c.reason
    return None


# -- rlkube local ---------------------------------------------------------------------------------------


def exited_process(tmp: Path, code: int) -> RoleProcess:
    """A real process that has already exited with `code` (what a crashed or finished role leaves)."""
    proc = RoleProcess("trainer", 0, [sys.executable, "-c", f"raise SystemExit({code})"], {}, tmp / "t.log").start()
    proc.proc.wait()
    return proc


def local_verdict(row: Row, now: datetime, tmp: Path) -> tuple[str, str] | None:
    manifest = {"apiVersion": EXAMPLE["apiVersion"], "kind": EXAMPLE["kind"], "metadata": {"name": "j"},
                "spec": raw_spec(row)}
    try:
        spec = parse_spec(manifest["spec"])
    except SpecError:
        result = run_local(manifest, tmp)  # judged before anything starts
        return (result.phase, result.reason)
    job = LocalJob("j", spec, manifest["spec"], tmp, Console(file=open("/dev/null", "w")))
    last_event = last_event_at(row, now)
    job.trainer_started_at = job.running_since = last_event - timedelta(seconds=10)
    job.last_event_at = last_event
    job.restarts["trainer"] = row.failures_before
    if row.trainer_fails_now:
        job.procs["trainer"] = [exited_process(tmp, 1)]
    elif row.exited_ago is not None:
        job.procs["trainer"] = [exited_process(tmp, 0)]
        job.trainer_exited_at = now - timedelta(seconds=row.exited_ago)
    if row.finished:
        step, ckpt, interrupted, ago = row.finished
        read = now - timedelta(seconds=ago)
        payload = {"type": protocol.TRAINING_FINISHED, "step": step, "checkpoint": ckpt, "interrupted": interrupted}
        job.finished = protocol.TrainerEvent(stream_id(read), protocol.TRAINING_FINISHED, payload)
        job.finished_at = read
    verdict = job.verdict(job._failed_processes())
    return (verdict.outcome.phase, verdict.outcome.reason) if verdict.outcome else None


@pytest.mark.parametrize("name", list(ROWS))
def test_operator_and_local_agree(name, tmp_path):
    row, expected = ROWS[name]
    now = datetime.now(timezone.utc)
    assert operator_verdict(row, now) == expected
    assert local_verdict(row, now, tmp_path) == expected
