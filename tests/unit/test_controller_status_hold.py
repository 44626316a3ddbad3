"""Which status changes the job loop may hold to send with a later write (job_io.routine_patch), and that a held
change is written by the first pass after its deadline, with nothing of it lost."""

from __future__ import annotations

import asyncio

from rlkube.api.status import TeardownStage, TeardownStatus, TrainingJobStatus
from rlkube.controller.reconcile import loop as loop_mod
from rlkube.controller.decisions.actions import Create, DeleteObject, DeletePod, Event
from rlkube.controller.decisions.recipe import Decision
from rlkube.controller.reconcile.job_io import COALESCE_SECONDS, routine_patch
from rlkube.controller.reconcile.loop import JobLoop, Shared


def _tearing_down(stage: str = "preprocessor") -> TrainingJobStatus:
    stages = [TeardownStage(name="actor", started_at="t0", finished_at="t1"), TeardownStage(name=stage, started_at="t1")]
    return TrainingJobStatus(phase="Draining", teardown=TeardownStatus(reason="Succeeded", stage=stage, stages=stages))


def test_routine_changes_may_wait():
    running = TrainingJobStatus(phase="Running")
    assert routine_patch({"conditions": []}, Decision(running))
    assert routine_patch({"progress": "2/10", "trainer": {"step": 2}, "lag": 1}, Decision(running))
    assert routine_patch({"teardown": {"stage": "inference"}},
                         Decision(_tearing_down(), actions=[DeletePod("p", "u", 10, "inference")]))


def test_what_must_be_written_at_once():
    running = TrainingJobStatus(phase="Running")
    assert not routine_patch({"phase": "Draining"}, Decision(running))
    assert not routine_patch({"observedGeneration": 2}, Decision(running))
    # A replaced pod: the restart it counts is stored before anything else happens.
    assert not routine_patch({"components": {}}, Decision(running, actions=[DeletePod("p", "u", 0, "actor")]))
    assert not routine_patch({"conditions": []}, Decision(running, actions=[Create({"kind": "Pod"})]))
    assert not routine_patch({"conditions": []}, Decision(running, events=[Event("Normal", "X", "y")]))
    # The pass looks again sooner than the hold would last (completionTimeoutSeconds after training_finished).
    assert not routine_patch({"completion": {}}, Decision(running, requeue_after=COALESCE_SECONDS / 2))
    assert routine_patch({"completion": {}}, Decision(running, requeue_after=COALESCE_SECONDS * 2))
    # The end of a teardown (its statics deleted) is not a stage-to-stage move.
    done = _tearing_down()
    done.teardown.stage = "Done"
    assert not routine_patch({"teardown": {"stage": "Done"}}, Decision(done, actions=[DeleteObject("ConfigMap", "c")]))


class _Writes:
    """Records the status patches the loop sends (the API server's side is tested by the operator tests)."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    async def patch_status(self, namespace: str, name: str, patch: dict) -> None:
        self.patches.append(patch)


def test_a_held_change_goes_out_with_the_first_write_after_its_deadline(monkeypatch):
    writes = _Writes()
    loop = JobLoop(Shared(kube=writes), "ns", "job")
    stored = TrainingJobStatus(phase="Running").model_dump(by_alias=True, mode="json", exclude_none=True)
    body = {"metadata": {"name": "job", "namespace": "ns", "uid": "u"}, "status": stored}
    clock = [1000.0]
    monkeypatch.setattr(loop_mod.time, "monotonic", lambda: clock[0])

    async def write(status: TrainingJobStatus) -> None:
        await loop._write_status(None, body, Decision(status))

    async def scenario() -> None:
        await write(TrainingJobStatus(phase="Running", progress="1/10"))
        assert writes.patches == [] and loop.flush_at == 1000.0 + COALESCE_SECONDS
        assert loop.status.progress == "1/10"  # the next pass starts from the held status
        clock[0] += COALESCE_SECONDS / 2
        await write(TrainingJobStatus(phase="Running", progress="2/10"))
        assert writes.patches == [] and loop.flush_at == 1000.0 + COALESCE_SECONDS  # the deadline does not move
        clock[0] += COALESCE_SECONDS
        await write(TrainingJobStatus(phase="Running", progress="3/10"))
        assert writes.patches == [{"progress": "3/10"}] and loop.flush_at is None
        await write(TrainingJobStatus(phase="Running", progress="4/10"))
        await write(TrainingJobStatus(phase="Draining", progress="4/10"))  # a phase change takes what is held along
        assert writes.patches[1:] == [{"phase": "Draining", "progress": "4/10"}] and loop.flush_at is None

    asyncio.run(scenario())
