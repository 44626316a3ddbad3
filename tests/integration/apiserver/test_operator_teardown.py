"""Ordered teardown against the real kube-apiserver: operator killed mid-teardown, deletion of a running job,
children of a finished job stay deleted, stuck pods are force-deleted with an Event."""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import pytest
from support.operator_harness import (  # noqa: F401 (fixtures)
    Env,
    assert_stage_order,
    children,
    create_job,
    delete_job,
    env,
    job_doc,
    job_events,
    kapi,
    wait_event,
)
from rlkube.lifecycle.roles import TEARDOWN_ORDER

pytestmark = pytest.mark.timeout(180)


async def _running(env: Env, kapi, name: str, **overrides):
    await create_job(kapi, env.namespace, job_doc(name, **overrides))
    trainer = await env.trainer(name)
    await env.recorder.wait_phase(name, "Running", timeout=60)
    return trainer


async def _succeed(env: Env, trainer, name: str, steps: int = 40) -> None:
    await trainer.finished(step=steps, checkpoint=f"/checkpoints/step-{steps}")
    await env.kubelet.exit(f"{name}-trainer-0", 0)


async def test_operator_killed_between_teardown_stages_resumes_where_it_stopped(env: Env, kapi):
    # Inference ignores SIGTERM and has a long grace period: the teardown waits in that stage.
    env.kubelet.held.add(("kill", "inference"))
    trainer = await _running(env, kapi, "kill", **{"teardown.gracePeriodSeconds.inference": 120})
    await _succeed(env, trainer, "kill")
    await env.recorder.wait(
        lambda: (env.recorder.status("kill").get("teardown") or {}).get("stage") == "inference", 30,
        "teardown waiting in the inference stage",
    )
    before = env.recorder.status("kill")["teardown"]["stages"]
    assert [s["name"] for s in before] == ["actor", "preprocessor", "inference"]
    assert before[0]["finishedAt"] and before[1]["finishedAt"] and not before[2].get("finishedAt")

    env.operator.kill()  # SIGKILL: no cleanup, mid-stage
    await env.kubelet.release("kill", "inference")  # the inference pod stops while no operator runs
    await env.kubelet.wait_for(lambda: all(p.gone_seq for p in env.kubelet.job_pods("kill") if p.role == "inference"),
                               20, "inference pod gone")
    env.operator.start()
    status = await env.recorder.wait_phase("kill", "Succeeded", timeout=60)

    stages = status["teardown"]["stages"]
    assert [s["name"] for s in stages] == list(TEARDOWN_ORDER)
    # Resumed, not restarted: the stages recorded before the kill kept their times.
    for old, new in zip(before, stages):
        assert old["startedAt"] == new["startedAt"], old["name"]
    assert before[0]["finishedAt"] == stages[0]["finishedAt"] and before[1]["finishedAt"] == stages[1]["finishedAt"]
    assert all(s["forced"] == 0 for s in stages)
    assert_stage_order(env, "kill")
    assert len(env.kubelet.job_pods("kill")) == 5  # nothing recreated
    assert await children(kapi, env.namespace, "kill") == {}  # nothing left


async def test_deleting_a_running_job_runs_the_ordered_teardown_before_it_disappears(env: Env, kapi):
    await _running(env, kapi, "del")
    await delete_job(kapi, env.namespace, "del")
    await env.recorder.wait(lambda: "del" in env.recorder.gone, 60, "TrainingJob removed")
    # The finalizer held the object until every pod was gone: none is left now (a list from the API server, not
    # the fake kubelet's watch, which is another stream and may not have delivered the last DELETED yet).
    assert [c for c in await children(kapi, env.namespace, "del") if c.startswith("Pod/")] == []

    # The last status written before the object went away: the whole teardown ran under the finalizer.
    last = env.recorder.status("del")
    assert last["teardown"]["reason"] == "Deleted" and last["teardown"]["stage"] == "Done"
    assert [s["name"] for s in last["teardown"]["stages"]] == list(TEARDOWN_ORDER)
    released = next(c for c in last["conditions"] if c["type"] == "ResourcesReleased")
    assert released["status"] == "True"
    assert "Succeeded" not in {c["type"] for c in last["conditions"]}
    assert env.recorder.phases["del"][-1] == "Draining"
    # Stage order is read from the fake kubelet's own watch (one stream, so its order is the API server's): wait
    # until it has seen every pod go. Its times are not compared with the recorder's (another stream): under load
    # the TrainingJob's DELETED has arrived there while the Redis pod's was still on its way here.
    await env.kubelet.wait_for(lambda: all(p.gone_seq for p in env.kubelet.job_pods("del")), 30, "every pod gone")
    assert_stage_order(env, "del")
    assert await children(kapi, env.namespace, "del") == {}


async def test_deleting_a_child_of_a_succeeded_job_does_not_bring_it_back(env: Env, kapi):
    trainer = await _running(env, kapi, "keep", **{"teardown.keepTrainerPod": True})
    await _succeed(env, trainer, "keep")
    await env.recorder.wait_phase("keep", "Succeeded", timeout=60)
    left = await children(kapi, env.namespace, "keep")
    assert set(left) == {"Pod/keep-trainer-0"}  # kept (completed) for its logs; everything else is gone
    passes = await env.operator.passes("keep")

    from kubernetes_asyncio import client

    await client.CoreV1Api(kapi).delete_namespaced_pod("keep-trainer-0", env.namespace)
    await env.kubelet.wait_for(lambda: not env.kubelet.live("keep"), 20, "trainer pod gone")
    # The operator still reacts to the pod event (a pass), and creates nothing.
    env.operator.stop()
    env.operator.start()  # and a restart does not resurrect anything either
    await env.operator.wait_passes("keep", 1)
    assert passes >= 1
    assert await children(kapi, env.namespace, "keep") == {}
    assert len(env.kubelet.job_pods("keep")) == 5
    assert env.recorder.status("keep")["phase"] == "Succeeded"


async def test_pods_that_ignore_sigterm_are_force_deleted_after_the_grace_period(env: Env, kapi):
    env.kubelet.held.add(("stuck", "actor"))
    trainer = await _running(env, kapi, "stuck", **{"teardown.gracePeriodSeconds.actor": 1})
    await _succeed(env, trainer, "stuck")
    status = await env.recorder.wait_phase("stuck", "Succeeded", timeout=60)
    actor_stage = status["teardown"]["stages"][0]
    assert actor_stage["name"] == "actor" and actor_stage["forced"] == 1
    forced = [e for e in await job_events(kapi, env.namespace, "stuck") if e[1] == "ForceDeleted"]
    assert forced and forced[0][0] == "Warning" and "stuck-actor-0" in forced[0][2]
    assert_stage_order(env, "stuck")
    metrics = await env.operator.metrics()
    assert 'rlkube_force_deletions_total{role="actor"} 1.0' in metrics
