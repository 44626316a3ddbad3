"""What users do to a running job besides suspending it, against the real kube-apiserver and real Redis.

- A ConfigMap, Secret or Service of the job deleted by hand comes back (same name, owned, labelled) because the
  operator watches those kinds; a finished job's children stay gone.
- A spec edit of a running job is reported (Event + condition SpecChangeIgnored) and not applied.
- A child the API server rejects as invalid (a hostPath volume whose path backs up with '..': the CRD schema and
  the operator's checks keep volume sources as written, the Pod validation does not) fails the job with the API
  server's message instead of retrying forever.
- Every role pod as the API server stored it mounts no ServiceAccount token, except where the role's template asks
  for one (tests/e2e/real_node/test_real_node_pods.py shows the same with the ServiceAccount admission plugin adding
  what it adds, and a shell inside each container finding no token).
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import asyncio
from itertools import pairwise

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from support.pod_security import assert_no_service_account_token
from support.operator_harness import (  # noqa: F401 (fixtures)
    Env,
    children,
    create_job,
    env,
    job_doc,
    job_events,
    kapi,
    patch_spec,
    wait_event,
)
from support import specs

pytestmark = pytest.mark.timeout(240)

STATIC = ("ConfigMap/{j}-config", "Secret/{j}-redis", "Service/{j}-redis", "Service/{j}-inference",
          "Service/{j}-trainer")


async def _delete(kapi, namespace: str, key: str) -> None:
    core = client.CoreV1Api(kapi)
    kind, name = key.split("/")
    delete = {"ConfigMap": core.delete_namespaced_config_map, "Secret": core.delete_namespaced_secret,
              "Service": core.delete_namespaced_service}[kind]
    await delete(name, namespace)


async def _wait_uid_changed(kapi, namespace: str, job: str, key: str, old_uid: str, timeout: float = 30) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        kids = await children(kapi, namespace, job)
        if key in kids and kids[key]["metadata"]["uid"] != old_uid:
            return kids[key]
        if loop.time() > deadline:
            raise TimeoutError(f"{key} not recreated in {timeout}s (present: {sorted(kids)})")
        await asyncio.sleep(0.2)  # a listing, not a watch: poll until the condition holds


async def test_static_children_deleted_by_hand_come_back_and_a_finished_job_keeps_them_gone(env: Env, kapi):
    job = await create_job(kapi, env.namespace, job_doc("hand"))
    trainer = await env.trainer("hand", timeout=60)
    await env.recorder.wait_phase("hand", "Running", timeout=90)
    before = await children(kapi, env.namespace, "hand")
    for key in (k.format(j="hand") for k in STATIC):
        await _delete(kapi, env.namespace, key)
        again = await _wait_uid_changed(kapi, env.namespace, "hand", key, before[key]["metadata"]["uid"])
        meta = again["metadata"]
        assert meta["ownerReferences"][0]["uid"] == job["metadata"]["uid"], key
        assert meta["labels"]["rlkube.io/job-name"] == "hand" and meta["labels"]["app.kubernetes.io/managed-by"] == "rlkube"
        if key.startswith("ConfigMap/"):
            assert again["data"] == before[key]["data"]
        if key.startswith("Service/"):
            assert again["spec"]["selector"] == before[key]["spec"]["selector"]
    events = await wait_event(kapi, env.namespace, "hand", "ChildRecreated", at_least=len(STATIC))
    named = {e[2].split(" was missing")[0] for e in events}
    assert named == {k.format(j="hand").replace("/", " ") for k in STATIC}
    assert all(e[0] == "Warning" for e in events)
    # Only the deleted objects were replaced: the pods are the first ones, and the job still runs to the end.
    assert len(env.kubelet.job_pods("hand")) == 5
    assert env.recorder.status("hand")["phase"] == "Running"
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("hand-trainer-0", 0)
    await env.recorder.wait_phase("hand", "Succeeded", timeout=60)
    assert await children(kapi, env.namespace, "hand") == {}

    # Finished: the job loop has stopped; a restarted operator reconciles the job again and recreates nothing.
    env.operator.stop()
    env.operator.start()
    await env.operator.wait_passes("hand", 1)
    assert await children(kapi, env.namespace, "hand") == {}
    assert env.recorder.status("hand")["phase"] == "Succeeded"


async def test_a_spec_edit_of_a_running_job_is_reported_once_and_not_applied(env: Env, kapi):
    await create_job(kapi, env.namespace, job_doc("edit"))
    trainer = await env.trainer("edit", timeout=60)
    await env.recorder.wait_phase("edit", "Running", timeout=90)
    await patch_spec(kapi, env.namespace, "edit", {"algorithm": {"maxSteps": 80}, "actor": {"replicas": 2}})
    await env.recorder.wait(
        lambda: (env.recorder.condition("edit", "SpecChangeIgnored") or {}).get("status") == "True", 30,
        "SpecChangeIgnored=True",
    )
    condition = env.recorder.condition("edit", "SpecChangeIgnored")
    assert condition["message"].startswith("spec.actor.replicas, spec.algorithm.maxSteps changed")
    assert env.recorder.status("edit")["observedGeneration"] == 2
    assert env.recorder.status("edit")["startedGeneration"] == 1
    warned = await wait_event(kapi, env.namespace, "edit", "SpecChangeIgnored")
    assert [(e[0], e[2]) for e in warned] == [("Warning", condition["message"])]
    # The trainer runs the spec it started with: it finishes at 40; the job succeeds, no second actor came.
    await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
    await env.kubelet.exit("edit-trainer-0", 0)
    status = await env.recorder.wait_phase("edit", "Succeeded", timeout=60)
    assert status["trainer"]["maxSteps"] == 40 and status["progress"] == "40/40"
    assert len([p for p in env.kubelet.job_pods("edit") if p.role == "actor"]) == 1
    events = await job_events(kapi, env.namespace, "edit")
    assert len([e for e in events if e[1] == "SpecChangeIgnored"]) == 1


async def test_a_child_the_api_server_rejects_fails_the_job_with_its_message(env: Env, kapi):
    # A hostPath that backs up with '..' in the actor's pod template: the CRD schema and `rlkube validate` keep
    # volume sources as written (too many kinds to model), the API server's Pod validation refuses it.
    template = {"spec": {"volumes": [{"name": "data", "hostPath": {"path": "/data/../etc"}}]}}
    await create_job(kapi, env.namespace, job_doc("badimg", **{"actor.template": template}))
    status = await env.recorder.wait_phase("badimg", "Failed", timeout=90)
    assert status["reason"] == "InvalidSpec"
    assert "Pod badimg-actor-0" in status["message"] and "hostPath.path" in status["message"]
    failed = env.recorder.condition("badimg", "Failed")
    assert failed["reason"] == "InvalidSpec" and failed["message"] == status["message"]
    events = await wait_event(kapi, env.namespace, "badimg", "InvalidSpec")
    assert any(e[0] == "Warning" and "hostPath.path" in e[2] for e in events)
    # Nothing more was created (no actor ever existed); what was created was torn down in the usual order.
    pods = env.kubelet.job_pods("badimg")
    assert sorted(p.role for p in pods) == ["inference", "preprocessor", "redis", "trainer"]
    assert all(p.gone_seq is not None for p in pods)
    by_role = {role: [p for p in pods if p.role == role] for role in specs.POD_ORDER if role != "actor"}
    for earlier, later in pairwise(by_role):
        assert max(p.gone_seq for p in by_role[earlier]) < min(p.deleting_seq for p in by_role[later])
    assert await children(kapi, env.namespace, "badimg") == {}
    with pytest.raises(ApiException):
        await client.CoreV1Api(kapi).read_namespaced_pod("badimg-actor-0", env.namespace)


async def test_every_role_pod_as_stored_mounts_no_service_account_token_unless_its_template_asks(env: Env, kapi):
    # The actor's template asks for the token (a process of the user's that talks to the API server): only its pods
    # get it; every other role's pod, Redis included, as the API server stored it, has none.
    await create_job(kapi, env.namespace, job_doc("token", **{
        "actor.template": {"spec": {"automountServiceAccountToken": True}}}))
    await env.recorder.wait_phase("token", "Running", timeout=90)
    core = client.CoreV1Api(kapi)
    stored = {p.metadata.labels["rlkube.io/role"]: kapi.sanitize_for_serialization(p) for p in
              (await core.list_namespaced_pod(env.namespace, label_selector="rlkube.io/job-name=token")).items}
    assert set(stored) == {"redis", "trainer", "inference", "preprocessor", "actor"}, sorted(stored)
    for role, pod in stored.items():
        if role == "actor":
            assert pod["spec"]["automountServiceAccountToken"] is True, pod["spec"]
        else:
            assert_no_service_account_token(pod)
