"""The validation gaps of tests/unit/test_validation_gaps.py against the real kube-apiserver and the operator process:
- an environment name that is no built-in is refused by the API server itself (the CRD's enum), naming the field,
  so nothing is stored;
- what the schema cannot say (two prompt sources, reasoning-gym's reserved config keys, sft without
  completionField) is stored, and the operator fails the job InvalidSpec with a Warning Event naming exactly the
  true fields, and creates nothing.
(The webhook served for real refuses the same at apply time: tests/integration/apiserver/test_chart_apply.py.)
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import json

import pytest
from kubernetes_asyncio.client.exceptions import ApiException
from support.operator_harness import (  # noqa: F401 (fixtures)
    Env,
    children,
    create_job,
    env,
    job_doc,
    job_events,
    kapi,
    wait_event,
)

pytestmark = pytest.mark.timeout(240)

CALCULATOR = {"name": "calculator"}
STORED_GAPS = {
    "two-sources": ({"task.environment": CALCULATOR, "task.reasoningGym": {"name": "basic_arithmetic"}},
                    {"spec.task.reasoningGym"}),
    "reserved-seed": ({"task.reasoningGym": {"name": "basic_arithmetic", "config": {"seed": 3}}},
                      {"spec.task.reasoningGym.config.seed"}),
    "sft-no-completion": ({"algorithm.loss": "sft", "task.dataset": {"path": "/data/prompts.jsonl"}},
                          {"spec.task.dataset.completionField"}),
}
"""Job name: (spec overrides, the only fields the operator may name)."""


def _fields(message: str) -> set[str]:
    return {part.split(": ", 1)[0] for part in message.split("; ")}


async def test_an_environment_name_no_built_in_is_refused_by_the_api_server_naming_the_field(env: Env, kapi):
    with pytest.raises(ApiException) as refused:
        await create_job(kapi, env.namespace, job_doc("noenv", **{"task.environment": {"name": "calculater"}}))
    assert refused.value.status == 422, refused.value.body
    (cause,) = json.loads(refused.value.body)["details"]["causes"]
    assert cause["field"] == "spec.task.environment.name", cause
    assert cause["message"] == 'Unsupported value: "calculater": supported values: "calculator", "verifiers"', cause
    assert await children(kapi, env.namespace, "noenv") == {}


async def test_what_the_schema_cannot_say_the_operator_refuses_naming_only_the_true_fields(env: Env, kapi):
    for name, (overrides, _) in STORED_GAPS.items():
        await create_job(kapi, env.namespace, job_doc(name, **overrides))
    for name, (_, fields) in STORED_GAPS.items():
        status = await env.recorder.wait_phase(name, "Failed", timeout=90)
        assert status["reason"] == "InvalidSpec" and _fields(status["message"]) == fields, status["message"]
        warned = await wait_event(kapi, env.namespace, name, "InvalidSpec")
        assert [e[0] for e in warned] == ["Warning"] and status["message"] in warned[0][2], warned
        if name == "sft-no-completion":  # sft scores nothing: it is not also told it needs a reward
            assert "spec.task.reward" not in status["message"], status["message"]
        assert await children(kapi, env.namespace, name) == {}
        assert env.kubelet.job_pods(name) == []
