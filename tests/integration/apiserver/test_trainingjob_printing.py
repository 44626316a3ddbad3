"""`kubectl get tj` and `kubectl explain tj` as the real kube-apiserver serves them.

- `kubectl get` asks the API server for a server-side Table (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`)
  and prints its cells; the API server fills them from the CRD's printer columns. The test reads that Table during
  and after a job run by the operator (subprocess; rlkube.bench.simulate plays the kubelet and the trainer)
  with `includeObject=Object`, so each row's cells are compared with the very object they were printed from, and
  with what the trainer reported.
- `kubectl explain` reads the API server's OpenAPI v2 document (/openapi/v2), which publishes the CRD's schema:
  the descriptions there are the pydantic field descriptions of rlkube.api.
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import json
import re
import time
from datetime import datetime

import pytest
from support.operator_harness import GROUP, PLURAL, VERSION, Env, create_job, env, job_doc, kapi  # noqa: F401
from rlkube.api.crd import PRINTER_COLUMNS, crd
from rlkube.api.spec import AlgorithmSpec, GracePeriods, RunPolicy, TrainingJobSpec
from rlkube.api.status import TrainerStatus, TrainingJobStatus
from rlkube.contract import protocol
from support.waiting import wait_for_async

pytestmark = pytest.mark.timeout(180)

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
DEFAULT_COLUMNS = ["Name", "Phase", "Step", "Lag", "Reward", "Age"]
"""What `kubectl get tj` shows without `-o wide` (priority 0)."""


async def get_json(kapi, path: str, accept: str = "application/json", query: list | None = None) -> dict:
    resp = await kapi.call_api(path, "GET", query_params=query or [], header_params={"Accept": accept},
                               auth_settings=["BearerToken"], _preload_content=False)
    try:
        assert resp.status == 200, (resp.status, await resp.text())
        return json.loads(await resp.read())
    finally:
        resp.release()


def age_seconds(cell: str) -> int:
    """Parse the API server's human-readable age (duration.HumanDuration) for ages under an hour."""
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", cell)
    assert m and cell, f"unexpected Age cell {cell!r}"
    return int(m.group(1) or 0) * 60 + int(m.group(2) or 0)


def _epoch(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


async def table_row(env: Env, kapi, name: str) -> tuple[dict, dict]:
    """`kubectl get tj` of the namespace as a Table: (cells by column name, the object they were printed from);
    the Age cell is checked here against the object's creationTimestamp and the time of the request."""
    t0 = time.time()
    table = await get_json(kapi, f"/apis/{GROUP}/{VERSION}/namespaces/{env.namespace}/{PLURAL}", TABLE,
                           [("includeObject", "Object")])
    t1 = time.time()
    assert table["kind"] == "Table" and table["apiVersion"] == "meta.k8s.io/v1"
    defs = table["columnDefinitions"]
    assert [(c["name"], c["priority"]) for c in defs] == [("Name", 0)] + [
        (c["name"], c.get("priority", 0)) for c in PRINTER_COLUMNS]
    assert [c["name"] for c in defs if c["priority"] == 0] == DEFAULT_COLUMNS
    for d, c in zip(defs[1:], PRINTER_COLUMNS, strict=True):
        assert d["description"] == c["description"]
    (row,) = [r for r in table["rows"] if r["object"]["metadata"]["name"] == name]
    cells = dict(zip([c["name"] for c in defs], row["cells"], strict=True))
    obj = row["object"]
    created = _epoch(obj["metadata"]["creationTimestamp"])
    assert int(t0 - created) - 1 <= age_seconds(cells["Age"]) <= int(t1 - created) + 1, (cells["Age"], t1 - created)
    return cells, obj


def check_cells_against_object(cells: dict, obj: dict) -> None:
    status = obj.get("status") or {}
    tr = status.get("trainer") or {}
    assert cells["Name"] == obj["metadata"]["name"]
    assert cells["Phase"] == status.get("phase")
    assert cells["Step"] == status.get("progress") == f"{tr.get('step', 0)}/{tr.get('maxSteps')}"
    assert cells["Lag"] == status.get("lag")
    assert cells["Reward"] == tr.get("rewardMean")
    assert cells["Tokens/s"] == tr.get("tokensPerSecond")
    assert cells["Backend"] == obj["spec"]["trainer"]["backend"]
    assert cells["Reason"] == status.get("reason")


async def test_kubectl_get_prints_truthful_columns_during_and_after_a_job(env: Env, kapi):
    name = "p"
    await create_job(kapi, env.namespace, job_doc(name, **{"algorithm.maxSteps": 3}))
    trainer = await env.trainer(name)
    await env.recorder.wait_phase(name, "Running", timeout=60)

    # Running, nothing reported by the trainer yet: no lag or reward is invented.
    cells, obj = await table_row(env, kapi, name)
    check_cells_against_object(cells, obj)
    assert (cells["Phase"], cells["Step"], cells["Lag"], cells["Reward"]) == ("Running", "0/3", None, None)

    # Two steps with their metrics events: the row shows step 2, its lag and its reward.
    for step, reward, lag in ((1, 0.25, 1), (2, 0.625, 2)):
        await trainer.weights_ready(step, documents_seen=32 * step)
        await trainer.raw(protocol.encode_event(protocol.METRICS, step=step, reward_mean=reward, lag_max=lag,
                                                tokens_per_s=1000.0 + step))
    await env.recorder.wait(lambda: (env.recorder.status(name).get("trainer") or {}).get("rewardMean") == 0.625,
                            20, "step 2's metrics in the status")
    cells, obj = await table_row(env, kapi, name)
    check_cells_against_object(cells, obj)
    assert (cells["Phase"], cells["Step"], cells["Lag"], cells["Reward"], cells["Tokens/s"]) == (
        "Running", "2/3", 2, 0.625, 1002.0)

    # The last step, the finished event, the trainer's exit 0: after the ordered teardown the row says Succeeded
    # and keeps the final figures.
    await trainer.weights_ready(3, documents_seen=96)
    await trainer.raw(protocol.encode_event(protocol.METRICS, step=3, reward_mean=0.875, lag_max=1, tokens_per_s=990.5))
    await trainer.checkpoint_saved(3, "/checkpoints/step-3")
    await trainer.finished(step=3, checkpoint="/checkpoints/step-3")
    await env.recorder.wait(lambda: (env.recorder.status(name).get("completion") or {}).get("streamId"), 20,
                            "the finished event in status")
    await env.kubelet.exit(f"{name}-trainer-0", 0)
    await env.recorder.wait_phase(name, "Succeeded", timeout=60)
    cells, obj = await table_row(env, kapi, name)
    check_cells_against_object(cells, obj)
    assert (cells["Phase"], cells["Step"], cells["Lag"], cells["Reward"], cells["Reason"]) == (
        "Succeeded", "3/3", 1, 0.875, "TrainingFinished")

    # One object as a Table (`kubectl get tj p`) prints the same cells.
    single = await get_json(kapi, f"/apis/{GROUP}/{VERSION}/namespaces/{env.namespace}/{PLURAL}/{name}", TABLE)
    (row,) = single["rows"]
    names = [c["name"] for c in single["columnDefinitions"]]
    assert {k: v for k, v in zip(names, row["cells"], strict=True) if k != "Age"} == {
        k: v for k, v in cells.items() if k != "Age"}


def _descriptions(schema: dict, path: str = "") -> dict[str, str]:
    out = {}
    if "description" in schema:
        out[path] = schema["description"]
    for key, sub in (schema.get("properties") or {}).items():
        out.update(_descriptions(sub, f"{path}.{key}"))
    return out


async def test_kubectl_explain_reads_the_field_descriptions_from_the_api_server(kapi):
    # The CRD is applied by the session fixture; the API server publishes its schema in /openapi/v2 shortly after.
    definition = f"io.rlkube.{VERSION}.TrainingJob"

    async def published_definition():
        return (await get_json(kapi, "/openapi/v2"))["definitions"].get(definition)

    published = await wait_for_async(published_definition, 60, f"{definition} in /openapi/v2", interval=0.5)
    assert published["x-kubernetes-group-version-kind"] == [{"group": GROUP, "kind": "TrainingJob", "version": VERSION}]

    # `kubectl explain tj`, `tj.spec`, `tj.spec.algorithm.maxSteps`, ...: the text is rlkube.api's descriptions.
    props = published["properties"]
    assert published["description"] == crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"]
    assert props["spec"]["description"] == TrainingJobSpec.__doc__
    spec = props["spec"]["properties"]
    assert spec["algorithm"]["properties"]["maxSteps"]["description"] == AlgorithmSpec.model_fields["max_steps"].description
    assert (spec["runPolicy"]["properties"]["eventTimeoutSeconds"]["description"]
            == RunPolicy.model_fields["event_timeout_seconds"].description)
    assert (spec["teardown"]["properties"]["gracePeriodSeconds"]["properties"]["trainer"]["description"]
            == GracePeriods.model_fields["trainer"].description)
    # Every description of the spec schema the operator generates comes back, field by field.
    generated = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    want, got = _descriptions(generated), _descriptions(props["spec"])
    assert len(want) > 50
    assert {k: v for k, v in want.items() if got.get(k) != v} == {}
    # The status is explained at its top level. Its fields are in v2 only if the CRD prunes unknown status fields:
    # for a node with x-kubernetes-preserve-unknown-fields, kube-apiserver 1.20 drops the properties from OpenAPI v2
    # (kubectl could not cope with both); OpenAPI v3 clients (a newer `kubectl explain`) read them from the CRD.
    assert props["status"]["description"] == TrainingJobStatus.__doc__
    generated = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    if generated.get("x-kubernetes-preserve-unknown-fields"):
        assert "properties" not in props["status"]
    else:
        want, got = _descriptions(generated), _descriptions(props["status"])
        assert {k: v for k, v in want.items() if got.get(k) != v} == {}
        assert got[".trainer.rewardMean"] == TrainerStatus.model_fields["reward_mean"].description
