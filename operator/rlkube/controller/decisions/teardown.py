"""The ordered teardown as a pure step function over `status.teardown` (docs/design.md §4.4).

Stages run one at a time in TEARDOWN_ORDER (actors, preprocessor, inference, trainer, Redis). A stage
starts by deleting its pods with the role's grace period, and finishes only when those pods are gone;
if they are still there KUBELET_KILL_SLACK after the grace period has run out, they are force-deleted (grace 0)
with a Warning Event. The kubelet kills a container that outlives its grace itself and only then lets its pod go:
force-deleting at the deadline would race it (the pod object gone, its container still running beside the next
stage: on the real kubelet under load a frozen actor died 1.7 s after its grace, after the preprocessor's stage
had begun). Forcing is for a kubelet that is gone (a lost node), not a slow one.

Progress (start/finish time of each stage) lives in the status, so an operator restarted
at any moment resumes at the stage it last wrote: a finished stage is never revisited, and as each step
is also a function of the pods, a stage written as started whose pods are gone by now just finishes, and
pods already deleting are not deleted again. (The loop may hold a stage-to-stage write a few seconds to
send it with the next: job_io.routine_patch.) The same sequence serves success, failure, deletion and
suspend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from rlkube.api.role import Role
from rlkube.api.spec import GracePeriods
from rlkube.api.status import TeardownStage, TeardownStatus
from rlkube.controller.decisions.actions import Action, DeletePod, DeleteStreams, Event
from rlkube.controller.decisions.observed import PodView
from rlkube.controller.decisions.times import fmt_time, parse_time
from rlkube.lifecycle.phases import EventType
from rlkube.lifecycle.roles import STAGE_ROLES, TEARDOWN_ORDER

DONE = "Done"
DELETION_TIMESTAMP_SLACK = timedelta(seconds=1)  # deletionTimestamp has whole seconds
KUBELET_KILL_SLACK = timedelta(seconds=10)  # the kubelet's own SIGKILL and pod removal after the grace (docstring)


@dataclass
class Step:
    """Result of advancing the teardown by one pass."""

    status: TeardownStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    deadline: datetime | None = None  # when a waiting stage's grace period runs out

    @property
    def done(self) -> bool:
        return self.status.stage == DONE


def _targets(role: str, pods: list[PodView], keep_trainer_pod: bool) -> list[PodView]:
    """Pods this stage must see gone. A kept trainer pod is one that already terminated (its logs stay)."""
    out = [p for p in pods if p.role in STAGE_ROLES.get(role, (role,))]
    if role == Role.TRAINER and keep_trainer_pod:
        out = [p for p in out if not p.terminated]
    return out


def advance(
    teardown: TeardownStatus,
    pods: list[PodView],
    grace: GracePeriods,
    keep_trainer_pod: bool,
    now: datetime,
    external_streams: tuple[str, ...] = (),
) -> Step:
    """Move the teardown as far as it can go now; `teardown.reason` must already be set."""
    td = teardown.model_copy(deep=True)
    step = Step(td)
    if td.stage == DONE:
        return step
    # No Event per stage (each is an API write, five per job; at scale they were a quarter of the operator's
    # writes): the stages are in the status as they run, and the Event at the end lists them all.
    for role in TEARDOWN_ORDER:
        stage = next((s for s in td.stages if s.name == role), None)
        if stage is not None and stage.finished_at is not None:
            continue
        targets = _targets(role, pods, keep_trainer_pod)
        # Each pod gets its own role's grace; the stage waits for the longest of them.
        period = max([grace.of(role), *(grace.of(p.role) for p in targets)])
        if stage is None:
            stage = TeardownStage(name=role, started_at=fmt_time(now))
            td.stages.append(stage)
            td.stage = role
            if role == Role.REDIS and external_streams:
                step.actions.append(DeleteStreams(external_streams))
        # (Re)issue deletes for pods not yet deleting: the first pass of the stage, or pods that were
        # created just before teardown began, or a pass whose deletes were lost with a killed operator.
        for p in targets:
            if not p.deleting:
                step.actions.append(DeletePod(p.name, p.uid, grace.of(p.role), role))
        if targets:
            started = parse_time(stage.started_at) or now
            # A pod's grace runs from when its delete reached the API server (deletionTimestamp = then + grace,
            # in whole seconds, so up to 1 s early), which under load is well after the stage began: forcing it
            # at stage start + period would cut its grace short.
            # (At most one more period: a pod someone else deleted with a longer grace does not hold the stage.)
            grace = timedelta(seconds=period)
            deadline = KUBELET_KILL_SLACK + max([started + grace, *(
                min(p.deletion_at, started + 2 * grace) + DELETION_TIMESTAMP_SLACK for p in targets if p.deletion_at)])
            if now >= deadline:
                stuck = [p for p in targets if p.deletion_grace != 0]
                for p in stuck:
                    step.actions.append(DeletePod(p.name, p.uid, 0, role, force=True))
                    step.events.append(
                        Event(
                            EventType.WARNING,
                            "ForceDeleted",
                            f"pod {p.name} still present {period}s after its {role} stage began and "
                            f"{KUBELET_KILL_SLACK.seconds}s more for its kubelet; force-deleted",
                        )
                    )
                stage.forced += len(stuck)
            else:
                step.deadline = deadline
            return step
        stage.finished_at = fmt_time(now)
    td.stage = DONE
    return step


def describe(stage: TeardownStage) -> str:
    started, finished = parse_time(stage.started_at), parse_time(stage.finished_at)
    took = (finished - started).total_seconds() if started and finished else 0.0
    forced = f", {stage.forced} force-deleted" if stage.forced else ""
    return f"{stage.name} stopped in {took:.1f}s{forced}"
