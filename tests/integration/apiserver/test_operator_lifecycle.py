"""The operator against the real kube-apiserver and real Redis: children, idempotence, a full successful job.

The operator runs as a subprocess (`rlkube operator --namespace NS --standalone`); rlkube.bench.simulate
plays the kubelet (pod status, exit codes, removal after SIGTERM) and the trainer (XADD of protocol events).
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import json
from itertools import pairwise

import pytest
from kubernetes_asyncio import client
from support.operator_harness import Env, children, create_job, env, job_doc, kapi  # noqa: F401 (fixtures)
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from support import specs

pytestmark = pytest.mark.timeout(180)


def _env(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0].get("env", [])}


async def test_example_creates_exactly_its_children_and_nothing_more(env: Env, kapi):
    doc = job_doc("tiny-cpu")
    job = await create_job(kapi, env.namespace, doc)
    await env.recorder.wait_phase("tiny-cpu", "Running", timeout=60)

    kids = await children(kapi, env.namespace, "tiny-cpu")
    assert set(kids) == {
        "ConfigMap/tiny-cpu-config",
        "Secret/tiny-cpu-redis",
        "Service/tiny-cpu-redis",
        "Service/tiny-cpu-inference",
        "Service/tiny-cpu-trainer",
        "Pod/tiny-cpu-redis",
        "Pod/tiny-cpu-trainer-0",
        "Pod/tiny-cpu-inference-0",
        "Pod/tiny-cpu-preprocessor-0",
        "Pod/tiny-cpu-actor-0",
    }
    for key, obj in kids.items():
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [
            {"apiVersion": "rlkube.io/v1alpha1", "kind": "TrainingJob", "name": "tiny-cpu",
             "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}
        ], key
        labels = meta["labels"]
        assert labels["app.kubernetes.io/managed-by"] == "rlkube" and labels["rlkube.io/job-name"] == "tiny-cpu", key
        if key.startswith("Pod/"):
            role = labels["rlkube.io/role"]
            assert labels["rlkube.io/index"] == "0"
            assert meta["name"] == ("tiny-cpu-redis" if role == "redis" else f"tiny-cpu-{role}-0")
    for svc in ("redis", "inference", "trainer"):
        spec = kids[f"Service/tiny-cpu-{svc}"]["spec"]
        assert spec["clusterIP"] == "None"
        assert all(p["port"] == p["targetPort"] for p in spec["ports"])

    trainer = kids["Pod/tiny-cpu-trainer-0"]
    assert trainer["spec"]["containers"][0]["command"] == ["python", "-m", "rlkube.core.trainer"]
    assert trainer["spec"]["hostname"] == "tiny-cpu-trainer-0" and trainer["spec"]["subdomain"] == "tiny-cpu-trainer"
    assert trainer["spec"]["restartPolicy"] == "OnFailure"
    assert trainer["spec"]["terminationGracePeriodSeconds"] == 2
    env_t = _env(trainer)
    assert env_t["RLKUBE_CONFIG"]["value"] == "/etc/rlkube/job.json"
    assert env_t["RLKUBE_REDIS_URL"]["value"] == "redis://tiny-cpu-redis:6379/0"
    assert env_t["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "tiny-cpu-redis", "key": "password"}
    assert env_t["RLKUBE_WEIGHT_SYNC_ADDR"]["value"] == "tiny-cpu-trainer-0.tiny-cpu-trainer:29500"
    assert env_t["RLKUBE_CHECKPOINT_DIR"]["value"] == "/checkpoints"
    assert env_t["RLKUBE_BIND_HOST"]["value"] == "$(POD_IP)"
    assert env_t["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert {v["name"]: v for v in trainer["spec"]["volumes"]}["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    actor_env = _env(kids["Pod/tiny-cpu-actor-0"])
    assert actor_env["RLKUBE_INFERENCE_URLS"]["value"] == "http://tiny-cpu-inference-0.tiny-cpu-inference:8000"
    inference = kids["Pod/tiny-cpu-inference-0"]["spec"]["containers"][0]
    assert inference["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000, "scheme": "HTTP"}
    redis = kids["Pod/tiny-cpu-redis"]["spec"]["containers"][0]
    assert redis["command"][:2] == ["redis-server", "--port"] and "$(REDIS_PASSWORD)" in redis["command"]
    assert redis["readinessProbe"]["tcpSocket"]["port"] == 6379
    config_json = kids["ConfigMap/tiny-cpu-config"]["data"]["job.json"]
    assert json.loads(config_json) == {"namespace": env.namespace, "name": "tiny-cpu", "uid": job["metadata"]["uid"],
                                       "spec": job["spec"]}

    # The operator reads events from its Redis pod (a real redis-server at the pod IP, password from the Secret).
    await env.recorder.wait(
        lambda: (env.recorder.condition("tiny-cpu", "EventSourceReachable") or {}).get("status") == "True",
        20, "EventSourceReachable=True",
    )

    def identity(objs: dict[str, dict]) -> dict[str, tuple[str, str]]:
        return {k: (v["metadata"]["uid"], v["metadata"]["resourceVersion"]) for k, v in objs.items() if k[:3] != "Pod"}

    before = {k: v["metadata"]["uid"] for k, v in kids.items()}
    static_before = identity(kids)

    # The handler again: an annotation change wakes the job (job-event) for one more pass.
    passes = await env.operator.passes("tiny-cpu")
    await client.CustomObjectsApi(kapi).patch_namespaced_custom_object(
        "rlkube.io", "v1alpha1", env.namespace, "trainingjobs", "tiny-cpu",
        {"metadata": {"annotations": {"test/touch": "1"}}}, _content_type="application/merge-patch+json",
    )
    await env.operator.wait_passes("tiny-cpu", passes + 1)
    again = await children(kapi, env.namespace, "tiny-cpu")
    assert {k: v["metadata"]["uid"] for k, v in again.items()} == before
    assert identity(again) == static_before

    # An operator restart: the new process reconciles the job and creates nothing.
    env.operator.stop()
    env.operator.start()
    await env.operator.wait_passes("tiny-cpu", 2)
    after = await children(kapi, env.namespace, "tiny-cpu")
    assert {k: v["metadata"]["uid"] for k, v in after.items()} == before
    assert identity(after) == static_before
    assert len(env.kubelet.job_pods("tiny-cpu")) == 5  # no pod was ever created twice
    assert env.recorder.status("tiny-cpu")["phase"] == "Running"


async def test_full_success_sequence_with_evidence_and_ordered_teardown(env: Env, kapi):
    await create_job(kapi, env.namespace, job_doc("ok", **{"algorithm.maxSteps": 3}))
    trainer = await env.trainer("ok")
    await env.recorder.wait_phase("ok", "Running", timeout=60)
    for step in (1, 2, 3):
        await trainer.weights_ready(step, documents_seen=32 * step)
    await trainer.checkpoint_saved(3, "/checkpoints/step-3")
    finished_id = await trainer.finished(step=3, checkpoint="/checkpoints/step-3")
    await env.recorder.wait(lambda: (env.recorder.status("ok").get("completion") or {}).get("streamId"), 20,
                            "the finished event in status")
    assert env.recorder.status("ok")["phase"] == "Running"  # the event alone decides nothing
    await env.kubelet.exit("ok-trainer-0", 0)
    status = await env.recorder.wait_phase("ok", "Succeeded", timeout=60)

    assert env.recorder.phases["ok"] == ["Pending", "Starting", "Running", "Draining", "Succeeded"]
    completion = status["completion"]
    assert completion["streamId"] == finished_id
    assert completion["finalStep"] == 3 and completion["checkpoint"] == "/checkpoints/step-3"
    assert completion["trainerExitCode"] == 0 and completion["eventTime"] and completion["trainerExitTime"]
    assert status["trainer"]["step"] == 3 and status["trainer"]["lastCheckpoint"]["step"] == 3
    assert status["trainer"]["documentsSeen"] == 96
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["Succeeded"]["status"] == "True" and conds["Succeeded"]["reason"] == "TrainingFinished"
    assert conds["ResourcesReleased"]["status"] == "True"
    assert "Failed" not in conds

    # Teardown order from what the API server did (fake kubelet's watch order): every pod of a stage was
    # gone before any pod of the next stage got its deletionTimestamp.
    pods = env.kubelet.job_pods("ok")
    assert all(p.gone_seq is not None for p in pods)
    by_role = {role: [p for p in pods if p.role == role] for role in specs.POD_ORDER}
    for earlier, later in pairwise(specs.POD_ORDER):
        if by_role[earlier] and by_role[later]:
            assert max(p.gone_seq for p in by_role[earlier]) < min(p.deleting_seq for p in by_role[later]), (
                earlier, later)
    stages = status["teardown"]["stages"]
    assert [s["name"] for s in stages] == list(TEARDOWN_ORDER)
    assert status["teardown"]["stage"] == "Done" and status["teardown"]["reason"] == "Succeeded"
    for a, b in pairwise(stages):
        assert a["finishedAt"] <= b["startedAt"]
    assert await children(kapi, env.namespace, "ok") == {}

    metrics = await env.operator.metrics()
    assert 'rlkube_trainingjobs{phase="Succeeded"} 1.0' in metrics
    assert 'rlkube_teardown_duration_seconds_count{reason="Succeeded"} 1.0' in metrics
    lag = next(line for line in metrics.splitlines() if line.startswith("rlkube_trainer_event_lag_seconds_count"))
    assert float(lag.split()[-1]) >= 5  # every event read: 3 weights_ready, checkpoint_saved, training_finished
    passes = next(line for line in metrics.splitlines() if line.startswith("rlkube_reconcile_duration_seconds_count"))
    assert float(passes.split()[-1]) > 0
