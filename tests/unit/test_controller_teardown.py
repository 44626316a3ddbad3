"""The ordered teardown step function: one stage at a time, wait until gone, force after grace, resumable."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from rlkube.api.spec import GracePeriods
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from rlkube.api.status import TeardownStatus
from rlkube.controller.decisions import teardown
from rlkube.controller.decisions.actions import DeletePod, DeleteStreams
from rlkube.controller.decisions.observed import PodView
from rlkube.controller.decisions.times import fmt_time

T0 = datetime(2025, 1, 1, tzinfo=UTC)
KILL = teardown.KUBELET_KILL_SLACK  # the kubelet kills a pod past its grace itself; forcing waits for it
GRACE = GracePeriods(actor=10, preprocessor=10, inference=20, trainer=60, redis=5)


def pod(role: str, index: int = 0, **kw) -> PodView:
    name = "j-redis" if role == "redis" else f"j-{role}-{index}"
    return PodView(name=name, uid=f"uid-{name}", role=role, index=index, phase=kw.pop("phase", "Running"), **kw)


def everything() -> list[PodView]:
    return [pod("redis"), pod("trainer"), pod("inference"), pod("inference", 1), pod("preprocessor"), pod("actor"),
            pod("actor", 1)]


def step(td, pods, now=T0, keep=False, streams=()):
    return teardown.advance(td, pods, GRACE, keep, now, streams)


def test_first_stage_deletes_only_the_actors_with_their_grace_period():
    s = step(TeardownStatus(reason="Succeeded"), everything())
    assert [(a.name, a.grace_seconds) for a in s.actions] == [("j-actor-0", 10), ("j-actor-1", 10)]
    assert s.status.stage == "actor" and s.deadline == T0 + timedelta(seconds=10) + KILL and not s.done
    assert s.status.stages[0].started_at == fmt_time(T0)


def test_a_stage_waits_until_its_pods_are_gone_then_the_next_starts_in_the_same_pass():
    s = step(TeardownStatus(reason="Failed"), everything())
    deleting = [p if p.role != "actor" else PodView(**{**p.__dict__, "deleting": True}) for p in everything()]
    waiting = step(s.status, deleting, now=T0 + timedelta(seconds=1))
    assert waiting.actions == [] and waiting.status.stage == "actor"  # already deleting: nothing re-issued
    gone = [p for p in everything() if p.role != "actor"]
    nxt = step(waiting.status, gone, now=T0 + timedelta(seconds=2))
    assert nxt.status.stages[0].finished_at == fmt_time(T0 + timedelta(seconds=2))
    assert nxt.status.stage == "preprocessor" and [a.name for a in nxt.actions] == ["j-preprocessor-0"]


def test_the_order_is_actors_preprocessor_inference_trainer_redis():
    td, pods, order = TeardownStatus(reason="Deleted"), everything(), []
    for i in range(10):
        s = step(td, pods, now=T0 + timedelta(seconds=i))
        deleted = {a.name for a in s.actions if isinstance(a, DeletePod)}
        order += sorted({p.role for p in pods if p.name in deleted})
        pods = [p for p in pods if p.name not in deleted]  # they stop at once
        td = s.status
        if s.done:
            break
    assert order == list(TEARDOWN_ORDER) and td.stage == "Done"
    assert [x.name for x in td.stages] == list(TEARDOWN_ORDER)


def test_pods_still_there_after_the_grace_period_are_force_deleted_once():
    s = step(TeardownStatus(reason="Succeeded"), everything())
    stuck = [PodView(**{**p.__dict__, "deleting": True}) if p.role == "actor" else p for p in everything()]
    kubelet_kills = step(s.status, stuck, now=T0 + timedelta(seconds=10))
    assert not [a for a in kubelet_kills.actions if isinstance(a, DeletePod)]  # its kubelet's SIGKILL comes first
    s = step(s.status, stuck, now=T0 + timedelta(seconds=10) + KILL)
    forced = [a for a in s.actions if isinstance(a, DeletePod) and a.force]
    assert [(a.name, a.grace_seconds) for a in forced] == [("j-actor-0", 0), ("j-actor-1", 0)]
    assert s.status.stages[0].forced == 2 and [e.reason for e in s.events] == ["ForceDeleted", "ForceDeleted"]
    assert all(e.type == "Warning" for e in s.events)
    # Still listed but already force-deleted (grace 0): not forced again.
    forced_view = [PodView(**{**p.__dict__, "deletion_grace": 0}) if p.role == "actor" else p for p in stuck]
    again = step(s.status, forced_view, now=T0 + timedelta(seconds=11) + KILL)
    assert again.actions == [] and again.status.stages[0].forced == 2


def test_a_delete_that_reached_the_api_server_late_still_gets_its_whole_grace():
    # The stage began at T0 but its deletes landed 4 s later (a loaded API server): the pods' deletionTimestamp is
    # T0 + 4 + 10 s, in whole seconds. Forcing them at T0 + 10 would cut their grace to 6 s.
    s = step(TeardownStatus(reason="Succeeded"), everything())
    late = T0 + timedelta(seconds=14)
    stuck = [PodView(**{**p.__dict__, "deleting": True, "deletion_grace": 10, "deletion_at": late})
             if p.role == "actor" else p for p in everything()]
    early = step(s.status, stuck, now=T0 + timedelta(seconds=10))
    assert not [a for a in early.actions if isinstance(a, DeletePod)]
    assert early.deadline == late + teardown.DELETION_TIMESTAMP_SLACK + KILL
    forced = step(early.status, stuck, now=late + teardown.DELETION_TIMESTAMP_SLACK + KILL)
    assert [a.name for a in forced.actions if isinstance(a, DeletePod) and a.force] == ["j-actor-0", "j-actor-1"]
    # Someone else's delete with a much longer grace does not hold the stage beyond one more period.
    held = [PodView(**{**p.__dict__, "deletion_at": T0 + timedelta(hours=1)}) for p in stuck]
    capped = step(early.status, held, now=T0 + timedelta(seconds=21) + KILL)
    assert [a.name for a in capped.actions if isinstance(a, DeletePod) and a.force] == ["j-actor-0", "j-actor-1"]


def test_resuming_after_a_restart_keeps_the_recorded_stages():
    td = TeardownStatus(reason="Succeeded", stage="inference")
    s0 = step(TeardownStatus(reason="Succeeded"), [])
    td.stages = [x.model_copy() for x in s0.status.stages[:2]]
    td.stages.append(s0.status.stages[2].model_copy(update={"finished_at": None}))
    pods = [pod("redis"), pod("trainer"), pod("inference", deleting=True)]
    s = step(td, pods, now=T0 + timedelta(seconds=5))
    assert [x.started_at for x in s.status.stages] == [x.started_at for x in td.stages]
    assert s.actions == [] and s.status.stage == "inference"
    assert s.deadline == T0 + timedelta(seconds=20) + KILL  # the inference grace counts from its recorded start


def test_a_kept_trainer_pod_that_completed_stays_but_a_running_trainer_is_stopped():
    done = pod("trainer", phase="Succeeded")
    s = step(TeardownStatus(reason="Succeeded", stage=None), [done], keep=True)
    assert s.done and s.actions == []
    s = step(TeardownStatus(reason="Succeeded"), [pod("trainer")], keep=True)
    assert [a.name for a in s.actions] == ["j-trainer-0"]


def test_external_streams_are_deleted_when_the_redis_stage_starts():
    s = step(TeardownStatus(reason="Succeeded"), [], streams=("ns/j/fast_llm_events",))
    assert s.done and [a for a in s.actions if isinstance(a, DeleteStreams)] == [DeleteStreams(("ns/j/fast_llm_events",))]
