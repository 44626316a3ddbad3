"""Every failure row of the operator's decision table, against the real kube-apiserver and real Redis.

One operator subprocess serves one namespace; each row is its own TrainingJob, and all rows are driven
concurrently (they only share the operator, like jobs in a real cluster), so the module takes about as
long as its slowest row. Each `scenario_*` coroutine plays kubelet and trainer and returns what it saw;
the test of the same name asserts on it.
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import asyncio
import uuid
from itertools import pairwise

import pytest
from kubernetes_asyncio import client
from support.operator_harness import (  # noqa: F401 (kapi is a fixture)
    Env,
    children,
    create_job,
    job_doc,
    job_events,
    kapi,
    patch_spec,
    wait_event,
)
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from support import specs

pytestmark = pytest.mark.timeout(300)

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__.removeprefix("scenario_")] = fn
    return fn


def cond(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


async def start(env: Env, kapi, name: str, **overrides):
    await create_job(kapi, env.namespace, job_doc(name, **overrides))
    trainer = await env.trainer(name, timeout=60)
    await env.recorder.wait_phase(name, "Running", timeout=90)
    return trainer


async def result(env: Env, kapi, name: str, phase: str) -> dict:
    status = await env.recorder.wait_phase(name, phase, timeout=90)
    return {
        "status": status,
        "phases": list(env.recorder.phases[name]),
        "events": await job_events(kapi, env.namespace, name),
        "pods": env.kubelet.job_pods(name),
        "children": await children(kapi, env.namespace, name),
    }


# -- completion rows ----------------------------------------------------------------------------------


@scenario
async def scenario_event_without_exit_with_checkpoint(env: Env, kapi):
    trainer = await start(env, kapi, "noexit-ok")
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")  # ... and the trainer hangs
    return await result(env, kapi, "noexit-ok", "Succeeded")


@scenario
async def scenario_event_without_exit_without_checkpoint(env: Env, kapi):
    trainer = await start(env, kapi, "noexit-bad")
    await trainer.finished(step=40)
    return await result(env, kapi, "noexit-bad", "Failed")


@scenario
async def scenario_exit_without_event(env: Env, kapi):
    await start(env, kapi, "noevent")
    await env.kubelet.exit("noevent-trainer-0", 0)
    return await result(env, kapi, "noevent", "Failed")


@scenario
async def scenario_interrupted_finish(env: Env, kapi):
    # This row is the exit path (event, then exit 0): the harness's 2 s completionTimeoutSeconds could run out
    # between the operator reading the event and seeing the exit while every row runs at once on a loaded machine
    # (seen: TrainerDidNotExit, the timeout row's verdict). The timeout rows keep 2 s.
    trainer = await start(env, kapi, "interrupted", **{"runPolicy.completionTimeoutSeconds": 60})
    await trainer.finished(step=17, checkpoint="/checkpoints/step-17")  # a scheduled/interrupted stop
    await env.kubelet.exit("interrupted-trainer-0", 0)
    return await result(env, kapi, "interrupted", "Failed")


# -- failure rows -------------------------------------------------------------------------------------


@scenario
async def scenario_trainer_restarts_in_place_with_retries_left(env: Env, kapi):
    trainer = await start(env, kapi, "retry-inplace", **{"runPolicy.backoffLimit": 2})
    await trainer.checkpoint_saved(10, "/checkpoints/step-10")
    await env.kubelet.exit("retry-inplace-trainer-0", 1)  # OnFailure: the kubelet restarts it in place
    await env.recorder.wait(lambda: env.recorder.status("retry-inplace").get("trainerRestarts") == 1, 30,
                            "trainer restart counted")
    phase_after_failure = env.recorder.status("retry-inplace")["phase"]
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("retry-inplace-trainer-0", 0)
    out = await result(env, kapi, "retry-inplace", "Succeeded")
    out["phase_after_failure"] = phase_after_failure
    return out


async def _running(core, namespace: str, name: str, timeout: float):
    """The pod once the kubelet has reported its container running (polled: the fake kubelet has no hook)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        pod = await core.read_namespaced_pod(name, namespace)
        statuses = pod.status.container_statuses or []
        if statuses and statuses[0].state and statuses[0].state.running:
            return pod
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"pod {name} not running after {timeout}s: {pod.status}")
        await asyncio.sleep(0.1)


@scenario
async def scenario_trainer_recreated_with_retries_left(env: Env, kapi):
    trainer = await start(env, kapi, "retry-never", **{"runPolicy.restartPolicy.trainer": "Never"})
    await trainer.checkpoint_saved(10, "/checkpoints/step-10")
    await env.recorder.wait(lambda: env.recorder.status("retry-never")["trainer"].get("lastCheckpoint"), 30,
                            "checkpoint recorded")
    first = env.kubelet.by_name["retry-never-trainer-0"]
    await env.kubelet.exit("retry-never-trainer-0", 1)  # Never: the pod fails; the operator replaces it
    await env.kubelet.wait_for(
        lambda: env.kubelet.by_name["retry-never-trainer-0"] != first
        and env.kubelet.pods[env.kubelet.by_name["retry-never-trainer-0"]].gone_seq is None,
        30, "a new trainer pod",
    )
    core = client.CoreV1Api(kapi)
    # The job stays Running through the restart, so wait for the replacement's container to run: a
    # training_finished written before its startedAt is (rightly) judged to come from the failed incarnation.
    replacement = await _running(core, env.namespace, "retry-never-trainer-0", 30)
    await env.recorder.wait(lambda: env.recorder.status("retry-never")["phase"] == "Running", 30, "Running")
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("retry-never-trainer-0", 0)
    out = await result(env, kapi, "retry-never", "Succeeded")
    out["first_uid"], out["replacement"] = first, replacement
    return out


@scenario
async def scenario_trainer_failure_without_retries(env: Env, kapi):
    await start(env, kapi, "backoff", **{"runPolicy.backoffLimit": 0})
    await env.kubelet.exit("backoff-trainer-0", 1)
    return await result(env, kapi, "backoff", "Failed")


@scenario
async def scenario_actor_failure_is_recreated_and_job_continues(env: Env, kapi):
    trainer = await start(env, kapi, "actor-fail", **{"runPolicy.restartPolicy.actor": "Never"})
    first = env.kubelet.by_name["actor-fail-actor-0"]
    await env.kubelet.exit("actor-fail-actor-0", 2)
    await env.kubelet.wait_for(
        lambda: env.kubelet.by_name["actor-fail-actor-0"] != first, 30, "a new actor pod"
    )
    await env.recorder.wait(
        lambda: (env.recorder.status("actor-fail")["components"]["actor"].get("ready") == 1
                 and env.recorder.status("actor-fail")["components"]["actor"].get("restarts") == 1),
        30, "actor back and counted",
    )
    mid = dict(env.recorder.status("actor-fail"))
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("actor-fail-trainer-0", 0)
    out = await result(env, kapi, "actor-fail", "Succeeded")
    out["mid"], out["first_uid"] = mid, first
    return out


@scenario
async def scenario_no_trainer_event_sets_stalled(env: Env, kapi):
    trainer = await start(env, kapi, "stall", **{"runPolicy.eventTimeoutSeconds": 1})
    await env.recorder.wait(lambda: cond(env.recorder.status("stall"), "Stalled").get("status") == "True", 30,
                            "Stalled=True")
    stalled = dict(env.recorder.status("stall"))
    await trainer.weights_ready(1, documents_seen=32)
    await env.recorder.wait(lambda: cond(env.recorder.status("stall"), "Stalled").get("status") == "False", 30,
                            "Stalled=False again")
    resumed = dict(env.recorder.status("stall"))
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("stall-trainer-0", 0)
    out = await result(env, kapi, "stall", "Succeeded")
    out["stalled"], out["resumed"] = stalled, resumed
    return out


@scenario
async def scenario_stall_fails_the_job_when_asked(env: Env, kapi):
    await start(env, kapi, "stall-fail", **{"runPolicy.eventTimeoutSeconds": 1, "runPolicy.failOnStall": True})
    return await result(env, kapi, "stall-fail", "Failed")


@scenario
async def scenario_redis_unreachable(env: Env, kapi):
    await start(env, kapi, "unreach")
    await env.recorder.wait(
        lambda: cond(env.recorder.status("unreach"), "EventSourceReachable").get("status") == "True", 30,
        "EventSourceReachable=True",
    )
    await asyncio.to_thread(env.kubelet.redis_server("unreach").stop)  # redis-server dies, the pod stays
    await env.recorder.wait(
        lambda: cond(env.recorder.status("unreach"), "EventSourceReachable").get("status") == "False", 30,
        "EventSourceReachable=False",
    )
    events = await wait_event(kapi, env.namespace, "unreach", "ConnectionError")
    return {"status": dict(env.recorder.status("unreach")), "events": events}


@scenario
async def scenario_external_redis_unreachable(env: Env, kapi):
    # Nothing listens on port 1 of loopback: the job's external Redis is down from the start.
    await create_job(kapi, env.namespace, job_doc("ext-down", **{"redis.mode": "external",
                                                                  "redis.url": "redis://127.0.0.1:1/0"}))
    await env.recorder.wait(
        lambda: cond(env.recorder.status("ext-down"), "EventSourceReachable").get("status") == "False", 30,
        "EventSourceReachable=False",
    )
    return {"status": dict(env.recorder.status("ext-down"))}


@scenario
async def scenario_suspend_and_resume(env: Env, kapi):
    await start(env, kapi, "susp")
    await patch_spec(kapi, env.namespace, "susp", {"runPolicy": {"suspend": True}})
    suspended = await env.recorder.wait_phase("susp", "Suspended", timeout=60)
    await env.recorder.wait(lambda: cond(env.recorder.status("susp"), "Suspended").get("status") == "True", 30,
                            "Suspended=True")
    suspended = dict(env.recorder.status("susp"))
    first_pods = env.kubelet.job_pods("susp")
    left = await children(kapi, env.namespace, "susp")
    await patch_spec(kapi, env.namespace, "susp", {"runPolicy": {"suspend": False}})
    await env.recorder.wait(
        lambda: env.recorder.phases["susp"][-1] == "Running" and "Suspended" in env.recorder.phases["susp"], 60,
        "Running again",
    )
    trainer = await env.trainer("susp")
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("susp-trainer-0", 0)
    out = await result(env, kapi, "susp", "Succeeded")
    out.update(suspended=suspended, first_pods=first_pods, left_while_suspended=left)
    return out


@scenario
async def scenario_invalid_spec(env: Env, kapi):
    # The schema accepts any string as model.path; only the operator knows which built-in models exist.
    await create_job(kapi, env.namespace, job_doc("invalid", **{"model.path": "builtin://tiny-gpt"}))
    out = await result(env, kapi, "invalid", "Failed")
    out["events"] = await wait_event(kapi, env.namespace, "invalid", "InvalidSpec")
    return out


@scenario
async def scenario_deleted_pod_of_running_job_is_recreated(env: Env, kapi):
    await start(env, kapi, "recreate")
    first = env.kubelet.by_name["recreate-preprocessor-0"]
    await client.CoreV1Api(kapi).delete_namespaced_pod("recreate-preprocessor-0", env.namespace)
    await env.kubelet.wait_for(
        lambda: env.kubelet.by_name["recreate-preprocessor-0"] != first, 30, "a new preprocessor pod"
    )
    return {"first": first, "second": env.kubelet.by_name["recreate-preprocessor-0"],
            "status": dict(env.recorder.status("recreate"))}


@scenario
async def scenario_ttl_after_finished_deletes_the_job(env: Env, kapi):
    trainer = await start(env, kapi, "ttl", **{"runPolicy.ttlSecondsAfterFinished": 1})
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("ttl-trainer-0", 0)
    out = await result(env, kapi, "ttl", "Succeeded")
    await env.recorder.wait(lambda: "ttl" in env.recorder.gone, 30, "the job deleted by its TTL")
    out["events"] = await job_events(kapi, env.namespace, "ttl")
    return out


@pytest.fixture(scope="module")
async def outcomes(kapi, cluster, tmp_path_factory):
    async with Env(kapi, cluster, f"fail-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("failures")) as env:
        tasks = {name: asyncio.create_task(fn(env, kapi), name=name) for name, fn in SCENARIOS.items()}
        yield tasks
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def outcome(outcomes, name: str) -> dict:
    return await outcomes[name]


def assert_released(out: dict) -> None:
    status = out["status"]
    assert cond(status, "ResourcesReleased")["status"] == "True"
    assert [s["name"] for s in status["teardown"]["stages"]] == list(TEARDOWN_ORDER)
    assert out["children"] == {}


# -- the tests ------------------------------------------------------------------------------------


async def test_event_without_exit_with_checkpoint(outcomes):
    out = await outcome(outcomes, "event_without_exit_with_checkpoint")
    succeeded = cond(out["status"], "Succeeded")
    assert succeeded["status"] == "True" and succeeded["reason"] == "TrainingFinished"
    assert "did not exit" in succeeded["message"]
    assert out["status"]["completion"].get("trainerExitCode") is None
    trainer = [p for p in out["pods"] if p.role == "trainer"]
    assert len(trainer) == 1 and trainer[0].deleting_seq is not None  # the hanging trainer was stopped
    assert_released(out)


async def test_event_without_exit_without_checkpoint(outcomes):
    out = await outcome(outcomes, "event_without_exit_without_checkpoint")
    failed = cond(out["status"], "Failed")
    assert failed["reason"] == "TrainerDidNotExit" and "Succeeded" not in {c["type"] for c in out["status"]["conditions"]}
    assert_released(out)


async def test_exit_without_event(outcomes):
    out = await outcome(outcomes, "exit_without_event")
    assert cond(out["status"], "Failed")["reason"] == "TrainerExitedWithoutFinishedEvent"
    assert out["status"]["reason"] == "TrainerExitedWithoutFinishedEvent"
    assert out["status"]["completion"]["trainerExitCode"] == 0 and not out["status"]["completion"].get("streamId")
    assert out["phases"][-2:] == ["Draining", "Failed"]
    assert_released(out)


async def test_interrupted_training_finished_is_not_a_success(outcomes):
    out = await outcome(outcomes, "interrupted_finish")
    assert cond(out["status"], "Failed")["reason"] == "TrainingInterrupted"
    assert out["status"]["completion"]["finalStep"] == 17 and out["status"]["completion"]["interrupted"] is True
    assert_released(out)


async def test_trainer_failure_with_retries_left_restarts_in_place(outcomes):
    out = await outcome(outcomes, "trainer_restarts_in_place_with_retries_left")
    assert out["phase_after_failure"] == "Running"
    assert out["status"]["trainerRestarts"] == 1 and out["status"]["components"]["trainer"]["restarts"] == 1
    assert any(e[1] == "TrainerRestarted" and e[0] == "Warning" for e in out["events"])
    assert cond(out["status"], "Succeeded")["reason"] == "TrainingFinished"
    assert len([p for p in out["pods"] if p.role == "trainer"]) == 1  # restarted in place, not recreated


async def test_trainer_failure_with_retries_left_is_recreated_from_checkpoint(outcomes):
    out = await outcome(outcomes, "trainer_recreated_with_retries_left")
    trainer_pods = [p for p in out["pods"] if p.role == "trainer"]
    assert len(trainer_pods) == 2 and out["first_uid"] != out["replacement"].metadata.uid
    assert out["replacement"].metadata.annotations["rlkube.io/resume-from-checkpoint"] == "/checkpoints/step-10"
    assert out["status"]["trainerRestarts"] == 1
    assert any(e[1] == "TrainerRestarted" and "checkpoint step 10" in e[2] for e in out["events"])
    assert cond(out["status"], "Succeeded")["status"] == "True"
    assert_released(out)


async def test_trainer_failure_without_retries_fails_the_job(outcomes):
    out = await outcome(outcomes, "trainer_failure_without_retries")
    failed = cond(out["status"], "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit is 0" in failed["message"]
    assert len([p for p in out["pods"] if p.role == "trainer"]) == 1  # nothing recreated
    assert_released(out)


async def test_actor_failure_is_recreated_and_the_job_continues(outcomes):
    out = await outcome(outcomes, "actor_failure_is_recreated_and_job_continues")
    assert out["mid"]["phase"] == "Running"
    actors = [p for p in out["pods"] if p.role == "actor"]
    assert len(actors) == 2 and actors[0].uid == out["first_uid"]
    assert any(e[1] == "ComponentRestarted" and "actor-fail-actor-0" in e[2] for e in out["events"])
    assert out["status"]["trainerRestarts"] == 0
    assert cond(out["status"], "Succeeded")["status"] == "True"
    assert_released(out)


async def test_no_trainer_event_for_event_timeout_sets_stalled(outcomes):
    out = await outcome(outcomes, "no_trainer_event_sets_stalled")
    stalled = cond(out["stalled"], "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "NoTrainerEvents"
    assert out["stalled"]["phase"] == "Running"
    assert cond(out["resumed"], "Stalled")["reason"] == "EventsResumed"
    assert any(e[0] == "Warning" and e[1] == "NoTrainerEvents" for e in out["events"])
    assert cond(out["status"], "Succeeded")["status"] == "True"


async def test_stall_fails_the_job_when_run_policy_says_so(outcomes):
    out = await outcome(outcomes, "stall_fails_the_job_when_asked")
    assert cond(out["status"], "Failed")["reason"] == "Stalled"
    assert cond(out["status"], "Stalled")["status"] == "True"
    assert_released(out)


async def test_redis_unreachable_sets_event_source_condition_with_reason(outcomes):
    out = await outcome(outcomes, "redis_unreachable")
    reach = cond(out["status"], "EventSourceReachable")
    assert reach["status"] == "False" and reach["reason"] == "ConnectionError"
    assert "6379" in reach["message"]
    assert out["status"]["phase"] == "Running"
    assert any(e[0] == "Warning" and e[1] == "ConnectionError" for e in out["events"])


async def test_external_redis_unreachable(outcomes):
    out = await outcome(outcomes, "external_redis_unreachable")
    reach = cond(out["status"], "EventSourceReachable")
    assert reach["status"] == "False" and reach["reason"] == "ConnectionError" and "127.0.0.1:1" in reach["message"]
    assert cond(out["status"], "RedisReady")["status"] == "False"


async def test_suspend_stops_in_order_and_resume_recreates(outcomes):
    out = await outcome(outcomes, "suspend_and_resume")
    s = out["suspended"]
    assert s["teardown"]["reason"] == "Suspended" and s["teardown"]["stage"] == "Done"
    assert [x["name"] for x in s["teardown"]["stages"]] == list(TEARDOWN_ORDER)
    assert out["left_while_suspended"] == {}
    first = out["first_pods"]
    assert len(first) == 5 and all(p.gone_seq for p in first)
    by_role = {r: [p for p in first if p.role == r] for r in specs.POD_ORDER}
    for a, b in pairwise(specs.POD_ORDER):
        assert max(p.gone_seq for p in by_role[a]) < min(p.deleting_seq for p in by_role[b])
    assert out["phases"][:6] == ["Pending", "Starting", "Running", "Suspended", "Pending", "Starting"]
    assert len(out["pods"]) == 10  # every component recreated on resume
    assert cond(out["status"], "Succeeded")["status"] == "True"


async def test_invalid_spec_fails_with_the_field_and_creates_nothing(outcomes):
    out = await outcome(outcomes, "invalid_spec")
    failed = cond(out["status"], "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.model.path" in failed["message"]
    assert out["pods"] == [] and out["children"] == {}
    assert any(e[0] == "Warning" and e[1] == "InvalidSpec" and "tiny-gpt" in e[2] for e in out["events"])


async def test_a_deleted_pod_of_a_running_job_is_recreated(outcomes):
    out = await outcome(outcomes, "deleted_pod_of_running_job_is_recreated")
    assert out["first"] != out["second"]
    assert out["status"]["phase"] == "Running"


async def test_ttl_after_finished_deletes_the_finished_job(outcomes):
    out = await outcome(outcomes, "ttl_after_finished_deletes_the_job")
    assert cond(out["status"], "Succeeded")["status"] == "True"
    assert_released(out)
