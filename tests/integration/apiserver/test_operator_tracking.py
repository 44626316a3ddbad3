"""spec.tracking through the operator on the real kube-apiserver: the W&B key goes from the user's Secret to the
trainer pod by reference only, and appears in no status, Event, ConfigMap, pod or operator log line; a failed
tracker is reported once per tracker (condition TrackerFailed, a Warning Event) and the job still succeeds.

The failures the stand-in trainer publishes are what the real fan-out produced in this process: one from MLflow at a
port nobody listens on, one from a tracker client whose error quotes the key (which the fan-out must strip).
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import base64
import json

import pytest
from kubernetes_asyncio import client
from support.operator_harness import Env, children, create_job, env, job_doc, job_events, kapi, wait_event  # noqa: F401

from rlkube.api.tracking import TrackingSpec
from rlkube.contract import protocol, runtime
from rlkube.core.tracking import build_trackers
from rlkube.local.ports import free_port

pytestmark = pytest.mark.timeout(240)

API_KEY = "rlkubeSecretKey" + "0123456789abcdefghijklmnopqrstuvwxyz"


class EchoingClient:
    """A tracker client that puts its credentials into its error (as a URL with the key in it would)."""

    name = "wandb"

    def open(self) -> None:
        raise PermissionError(f"401 Unauthorized for https://api:{API_KEY}@wandb.example/graphql (key {API_KEY})")


def real_failures() -> list:
    spec = TrackingSpec.model_validate({"mlflow": {"trackingUri": f"http://127.0.0.1:{free_port()}"}})
    trackers = build_trackers(spec, "ns", "keyed", None, env={runtime.ENV_WANDB_API_KEY: API_KEY})
    trackers.add(EchoingClient())
    trackers.log_metrics({"train/loss": 1.0}, 1)
    trackers.close(timeout_s=30)
    failures = trackers.take_failures()
    assert sorted(f.tracker for f in failures) == ["mlflow", "wandb"], failures
    return failures


async def test_wandb_key_stays_in_its_secret_and_a_failed_tracker_is_reported_once(env: Env, kapi):
    core = client.CoreV1Api(kapi)
    await core.create_namespaced_secret(env.namespace, {
        "metadata": {"name": "wandb"}, "data": {"apiKey": base64.b64encode(API_KEY.encode()).decode()}})
    doc = job_doc("keyed", **{"algorithm.maxSteps": 3, "tracking": {
        "wandb": {"project": "rlkube", "apiKeySecret": {"name": "wandb", "key": "apiKey"}},
        "mlflow": {"trackingUri": "http://mlflow.example:5000"}}})
    await create_job(kapi, env.namespace, doc)
    trainer = await env.trainer("keyed")
    await env.recorder.wait_phase("keyed", "Running", timeout=60)

    kids = await children(kapi, env.namespace, "keyed")
    pod_env = {e["name"]: e for e in kids["Pod/keyed-trainer-0"]["spec"]["containers"][0]["env"]}
    assert pod_env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY",
                                        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "apiKey"}}}
    for name, kid in kids.items():
        if name.startswith("Pod/") and not name.startswith("Pod/keyed-trainer"):
            assert "WANDB_API_KEY" not in json.dumps(kid), name  # only the trainer logs to trackers

    failures = real_failures()
    for step in (1, 2, 3):
        await trainer.weights_ready(step, documents_seen=32 * step)
        if step == 1:
            for f in failures:
                await trainer.raw(protocol.encode_event(protocol.TRACKER_FAILED, tracker=f.tracker, message=f.message))
        if step == 2:  # a restarted trainer finds MLflow failing again: not reported a second time
            mlflow = next(f for f in failures if f.tracker == "mlflow")
            await trainer.raw(protocol.encode_event(protocol.TRACKER_FAILED, tracker="mlflow", message=mlflow.message))
    await trainer.checkpoint_saved(3, "/checkpoints/step-3")
    await trainer.finished(step=3, checkpoint="/checkpoints/step-3")
    await env.kubelet.exit("keyed-trainer-0", 0)
    status = await env.recorder.wait_phase("keyed", "Succeeded", timeout=60)

    tracker_conditions = [c for c in status["conditions"] if c["type"] == "TrackerFailed"]
    assert len(tracker_conditions) == 1, status["conditions"]
    (condition,) = tracker_conditions
    assert condition["status"] == "True" and condition["reason"] == "TrackerFailed"
    lines = condition["message"].splitlines()
    assert sorted(line.split(" failed: ")[0] for line in lines) == ["mlflow", "wandb"], lines
    assert "[redacted]" in next(line for line in lines if line.startswith("wandb"))
    events = await wait_event(kapi, env.namespace, "keyed", "TrackerFailed", at_least=2)
    assert sorted(e[2].split(" failed: ")[0] for e in events) == ["mlflow", "wandb"]
    assert all(e[0] == "Warning" for e in events)

    # The key is nowhere the operator writes or logs: status, Events, ConfigMaps, pods, its log.
    everything = {
        "status": json.dumps(status),
        "job": json.dumps(await client.CustomObjectsApi(kapi).get_namespaced_custom_object(
            "rlkube.io", "v1alpha1", env.namespace, "trainingjobs", "keyed")),
        "events": json.dumps([kapi.sanitize_for_serialization(e)
                              for e in (await core.list_namespaced_event(env.namespace)).items]),
        "configmaps": json.dumps([kapi.sanitize_for_serialization(c)
                                  for c in (await core.list_namespaced_config_map(env.namespace)).items]),
        "children while running (ConfigMap, pods)": json.dumps(kids),
        "operator log": env.operator.log(),
    }
    assert "ConfigMap/keyed-config" in kids and "apiKeySecret" in json.dumps(kids["ConfigMap/keyed-config"])
    leaks = [where for where, text in everything.items() if API_KEY in text]
    assert leaks == [], leaks


@pytest.mark.parametrize("tracking, field", [
    ({"mlflow": {"trackingUri": "mlflow:5000"}}, "spec.tracking.mlflow.trackingUri"),
    ({"wandb": {"project": "p", "mode": "shared"}}, "spec.tracking.wandb.mode"),
    ({"wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}}}, "spec.tracking.wandb.apiKeySecret.key"),
    ({"tensorboard": {"directory": "../out"}}, "spec.tracking.tensorboard.directory"),
])
async def test_the_api_server_refuses_bad_tracking_fields_naming_them(env: Env, kapi, tracking, field):
    from kubernetes_asyncio.client.exceptions import ApiException

    with pytest.raises(ApiException) as err:
        await create_job(kapi, env.namespace, job_doc("bad", tracking=tracking))
    assert err.value.status == 422 and field in err.value.body, err.value.body
