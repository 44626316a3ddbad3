"""The operator's per-job Prometheus metrics, scraped during and after a real job, against the job's status.

The operator runs as a subprocess against the real kube-apiserver; the managed Redis is a real redis-server
(rlkube.bench.simulate plays the kubelet and the trainer, which writes protocol events byte for byte). At
each point the test reads the TrainingJob from the API server, scrapes /metrics, and reads the job again; a
comparison counts only when both reads are the same resourceVersion (nothing was written in between), so each
metric is checked against the status the API server held at the moment of the scrape.
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import asyncio
import time
from datetime import datetime

import pytest
from kubernetes_asyncio import client
from support.operator_harness import (  # noqa: F401
    GROUP, PLURAL, VERSION, Env, create_job, delete_job, env, job_doc, kapi,
)
from prometheus_client.parser import text_string_to_metric_families
from rlkube.contract import protocol

pytestmark = pytest.mark.timeout(180)

PREFIX = "rlkube_trainingjob_"
PHASES = ("Pending", "Starting", "Running", "Draining", "Succeeded", "Failed", "Suspended")


def series(text: str, namespace: str, job: str) -> dict[tuple[str, tuple], float]:
    """Every `rlkube_trainingjob_*` sample of one job: (name, extra labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX) and s.labels.get("namespace") == namespace and s.labels.get("trainingjob") == job:
                extra = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("namespace", "trainingjob")))
                out[(s.name[len(PREFIX):], extra)] = s.value
    return out


def _epoch(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def expected(status: dict) -> dict[tuple[str, tuple], float]:
    """What the metrics must say for this status (written from the status JSON, not from the operator's code);
    seconds-since-the-last-event is checked separately (it depends on the scrape time)."""
    tr = status.get("trainer") or {}
    out: dict[tuple[str, tuple], float] = {}
    for p in PHASES:
        out[("status_phase", (("phase", p),))] = 1.0 if status.get("phase") == p else 0.0
    out[("step", ())] = tr.get("step", 0)
    out[("max_steps", ())] = tr.get("maxSteps", 0)
    out[("weights_version", ())] = tr.get("weightsVersion", 0)
    for field, name in ((status.get("lag"), "policy_lag"), (tr.get("rewardMean"), "reward_mean"),
                        (tr.get("tokensPerSecond"), "tokens_per_second")):
        if field is not None:
            out[(name, ())] = field
    for component, c in (status.get("components") or {}).items():
        out[("component_restarts", (("component", component),))] = c.get("restarts", 0)
    for stage in (status.get("teardown") or {}).get("stages", []):
        if stage.get("startedAt") and stage.get("finishedAt"):
            seconds = _epoch(stage["finishedAt"]) - _epoch(stage["startedAt"])
            out[("teardown_stage_duration_seconds", (("stage", stage["name"]),))] = seconds
    return out


async def read_job(kapi, namespace: str, name: str) -> dict:
    return await client.CustomObjectsApi(kapi).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


async def scrape_matches_status(env: Env, kapi, name: str, timeout: float = 15) -> tuple[dict, dict]:
    """Until a scrape between two identical reads of the job agrees with its status; returns (status, metrics).

    The operator sets the metrics right after its status patch returns, so a read can catch the status a moment
    before the metrics: such a snapshot is retried, and the last disagreement is the failure message."""
    start = time.monotonic()
    deadline = start + timeout
    attempts = 0
    while True:
        attempts += 1
        before = await read_job(kapi, env.namespace, name)
        t0 = time.time()
        got = series(await env.operator.metrics(), env.namespace, name)
        t1 = time.time()
        after = await read_job(kapi, env.namespace, name)
        problems = ["the job changed during the scrape"]
        if before["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"]:
            status = after.get("status") or {}
            want = expected(status)
            since = got.pop(("seconds_since_last_trainer_event", ()), None)
            problems = [f"{k}: metric {got.get(k)} != status {v}" for k, v in want.items()
                        if got.get(k) is None or abs(got[k] - v) > 1e-6]
            problems += [f"{k}: metric {got[k]} not in the status" for k in got.keys() - want.keys()]
            last = (status.get("trainer") or {}).get("lastEventTime")
            if last is None:
                if since is not None:
                    problems.append(f"seconds since last event {since} without a lastEventTime")
            elif since is None or not (t0 - _epoch(last) - 1e-3 <= since <= t1 - _epoch(last) + 1e-3):
                problems.append(f"seconds since last event {since} not in [{t0 - _epoch(last)}, {t1 - _epoch(last)}]")
            if not problems:
                print(f"{name} {status.get('phase')}: {len(got)} series match the status (attempt {attempts}, "
                      f"{time.monotonic() - start:.2f} s)")
                if since is not None:
                    got[("seconds_since_last_trainer_event", ())] = since
                return status, got
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics of {name} never matched its status: {problems}")
        await asyncio.sleep(0.1)


def metrics_event(step: int, **payload) -> dict:
    return protocol.encode_event(protocol.METRICS, step=step, **payload)


async def test_metrics_follow_the_job_status_during_and_after_a_job_and_go_with_it(env: Env, kapi):
    name = "m"
    await create_job(kapi, env.namespace, job_doc(name, **{"algorithm.maxSteps": 3}))
    trainer = await env.trainer(name)
    await env.recorder.wait_phase(name, "Running", timeout=60)

    # Before any metrics event: no lag, reward or throughput series (nothing measured yet), phase Running.
    status, got = await scrape_matches_status(env, kapi, name)
    assert got[("status_phase", (("phase", "Running"),))] == 1
    assert ("reward_mean", ()) not in got and ("policy_lag", ()) not in got

    # Two steps with their metrics events, and an actor that crashes once (restartPolicy OnFailure: in place).
    await trainer.weights_ready(1, documents_seen=32)
    await trainer.raw(metrics_event(1, reward_mean=0.25, tokens_per_s=812.34, lag_max=1, loss=0.5))
    await trainer.weights_ready(2, documents_seen=64)
    await trainer.raw(metrics_event(2, reward_mean=0.625, tokens_per_s=900.04, lag_max=2, loss=0.4))
    await env.kubelet.exit(f"{name}-actor-0", 1)
    await env.recorder.wait(
        lambda: (env.recorder.status(name).get("trainer") or {}).get("rewardMean") == 0.625
        and env.recorder.status(name)["components"]["actor"]["restarts"] == 1,
        20, "step 2's metrics and the actor's restart in the status",
    )
    status, got = await scrape_matches_status(env, kapi, name)
    assert status["phase"] == "Running"
    # ... and what the status says is what the trainer and the kubelet did.
    assert got[("step", ())] == 2 and got[("max_steps", ())] == 3 and got[("policy_lag", ())] == 2
    assert got[("reward_mean", ())] == 0.625 and got[("tokens_per_second", ())] == 900.0
    assert got[("component_restarts", (("component", "actor"),))] == 1
    assert got[("component_restarts", (("component", "trainer"),))] == 0
    assert ("teardown_stage_duration_seconds", (("stage", "actor"),)) not in got
    since_running = got[("seconds_since_last_trainer_event", ())]

    # Seconds since the last event grows at scrape time with no new event (no poller writes it): the bounds
    # checked above are the scrape's own clock; here the same last event, 1.5 s later.
    await asyncio.sleep(1.5)  # the quantity under test is elapsed time itself
    later, got_later = await scrape_matches_status(env, kapi, name)
    assert later["trainer"]["lastEventTime"] == status["trainer"]["lastEventTime"]
    assert got_later[("seconds_since_last_trainer_event", ())] >= since_running + 1.5

    # The job finishes: final step, finished event, trainer exit 0 -> ordered teardown -> Succeeded.
    await trainer.weights_ready(3, documents_seen=96)
    await trainer.raw(metrics_event(3, reward_mean=0.875, tokens_per_s=950.0, lag_max=1))
    await trainer.checkpoint_saved(3, "/checkpoints/step-3")
    await trainer.finished(step=3, checkpoint="/checkpoints/step-3")
    await env.recorder.wait(lambda: (env.recorder.status(name).get("completion") or {}).get("streamId"), 20,
                            "the finished event in status")
    await env.kubelet.exit(f"{name}-trainer-0", 0)
    await env.recorder.wait_phase(name, "Succeeded", timeout=60)
    status, got = await scrape_matches_status(env, kapi, name)
    assert got[("status_phase", (("phase", "Succeeded"),))] == 1
    assert sum(v for (n, _), v in got.items() if n == "status_phase") == 1
    assert got[("step", ())] == 3 and got[("reward_mean", ())] == 0.875 and got[("policy_lag", ())] == 1
    stages = {dict(labels)["stage"]: v for (n, labels), v in got.items() if n == "teardown_stage_duration_seconds"}
    assert set(stages) == {"actor", "preprocessor", "inference", "trainer", "redis"}
    assert all(v >= 0 for v in stages.values())
    assert got[("component_restarts", (("component", "actor"),))] == 1

    # Deleted: the job's series go with it (their number follows the jobs that exist).
    await delete_job(kapi, env.namespace, name)
    await env.recorder.wait(lambda: name in env.recorder.gone, 30, f"{name} deleted")
    deadline = time.monotonic() + 15
    while True:
        text = await env.operator.metrics()
        left = [line for line in text.splitlines() if f'trainingjob="{name}"' in line]
        if not left:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"series of the deleted job remain: {left}")
        await asyncio.sleep(0.1)
