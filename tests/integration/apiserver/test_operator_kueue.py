"""Kueue against the real kube-apiserver: a queued TrainingJob is gated until admitted, placed by the admission,
stopped in order on eviction, resumed from its checkpoint on re-admission, and its Workload marked Finished.

Kueue's Workload and ResourceFlavor CRDs are installed from tests/fixtures/kueue (trimmed from Kueue's source,
see trim.py there). No Kueue controller runs: this test plays Kueue's scheduler, as the fake kubelet plays the
kubelet, by writing what Kueue writes into the Workload's status (the Admission, QuotaReserved/Admitted as
pkg/workload SetQuotaReservation + SyncAdmittedCondition set them, then Evicted as a preemption sets it).
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from itertools import pairwise

import pytest
import yaml
from kubernetes_asyncio import client
from support.operator_harness import Env, children, create_job, env, job_doc, kapi  # noqa: F401 (fixtures)
from rlkube.controller.decisions import kueue
from rlkube.controller.manifests import names
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from support import TESTS, specs
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

FIXTURES = TESTS / "fixtures" / "kueue"
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="session")
def kueue_crds(api_client):
    """Kueue's Workload and ResourceFlavor CRDs (v1beta2, trimmed for kube-apiserver 1.20), Established."""
    from kubernetes import client as sync_client
    from kubernetes.client.rest import ApiException

    ext = sync_client.ApiextensionsV1Api(api_client)
    for kind in ("workloads", "resourceflavors"):
        body = yaml.safe_load((FIXTURES / f"kueue.x-k8s.io_{kind}.yaml").read_text())
        try:
            ext.create_custom_resource_definition(body)
        except ApiException as exc:
            if exc.status != 409:
                raise
        wait_for(lambda: any(c.type == "Established" and c.status == "True"
                             for c in ext.read_custom_resource_definition(body["metadata"]["name"]).status.conditions
                             or []), 60, f"the {kind} CRD to be Established")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cond(type_: str, status: str, reason: str, message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": _now()}


class KueuePlayer:
    """Writes what Kueue's scheduler writes into a Workload's status."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace

    async def workloads(self) -> list[dict]:
        found = await self.custom.list_namespaced_custom_object(kueue.GROUP, kueue.VERSION, self.namespace, "workloads")
        return found["items"]

    async def get(self, name: str) -> dict:
        return await self.custom.get_namespaced_custom_object(kueue.GROUP, kueue.VERSION, self.namespace, "workloads",
                                                              name)

    async def wait(self, name: str, predicate, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                wl = await self.get(name)
                if predicate(wl):
                    return wl
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"Workload {name}: {what} not reached in {timeout}s")
            await asyncio.sleep(0.2)  # polling a condition: the test has no Workload watch

    async def _status(self, name: str, status: dict) -> None:
        await self.custom.patch_namespaced_custom_object_status(
            kueue.GROUP, kueue.VERSION, self.namespace, "workloads", name, {"status": status},
            _content_type="application/merge-patch+json",
        )

    async def admit(self, wl: dict, cluster_queue: str, flavors: dict[str, dict[str, str]]) -> None:
        """QuotaReserved + Admitted with one assignment per pod set (`flavors`: pod set -> resource -> flavour)."""
        conds = [c for c in (wl.get("status") or {}).get("conditions", []) if c["type"] not in
                 (kueue.QUOTA_RESERVED, kueue.ADMITTED, kueue.EVICTED)]
        reserved = f"Quota reserved in ClusterQueue {cluster_queue}"
        conds.append(_cond(kueue.QUOTA_RESERVED, "True", "QuotaReserved", reserved))
        conds.append(_cond(kueue.ADMITTED, "True", "Admitted", "The workload is admitted"))
        evicted = next((c for c in (wl.get("status") or {}).get("conditions", []) if c["type"] == kueue.EVICTED), None)
        if evicted is not None:  # SetQuotaReservation resets an active Evicted condition
            conds.append(_cond(kueue.EVICTED, "False", "QuotaReserved", "Previously: " + evicted["message"]))
        admission = {
            "clusterQueue": cluster_queue,
            "podSetAssignments": [
                {"name": ps["name"], "flavors": flavors[ps["name"]], "count": ps["count"]}
                for ps in wl["spec"]["podSets"]
            ],
        }
        await self._status(wl["metadata"]["name"], {"conditions": conds, "admission": admission})

    async def evict(self, wl: dict, reason: str, message: str) -> None:
        conds = [c for c in wl["status"]["conditions"] if c["type"] != kueue.EVICTED]
        conds.append(_cond(kueue.EVICTED, "True", reason, message))
        await self._status(wl["metadata"]["name"], {"conditions": conds})


def _cond_of(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


async def _pods(kapi, namespace: str, job: str) -> dict[str, dict]:
    return {k.split("/", 1)[1]: v for k, v in (await children(kapi, namespace, job)).items() if k.startswith("Pod/")}


async def test_kueue_gates_places_evicts_resumes_and_finishes(env: Env, kapi, kueue_crds):
    custom = client.CustomObjectsApi(kapi)
    suffix = uuid.uuid4().hex[:6]
    gpu, default = f"gpu-{suffix}", f"default-{suffix}"
    gpu_labels = {"cloud.example.com/accelerator": "a100", "pool": f"gpu-{suffix}"}
    for name, spec in ((gpu, {"nodeLabels": gpu_labels, "tolerations": [GPU_TOLERATION]}), (default, {})):
        await custom.create_cluster_custom_object(kueue.GROUP, kueue.VERSION, "resourceflavors",
                                                  {"apiVersion": kueue.API_VERSION, "kind": "ResourceFlavor",
                                                   "metadata": {"name": name}, "spec": spec})
    kq = KueuePlayer(kapi, env.namespace)
    try:
        doc = job_doc("kq")
        doc["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a"}
        job = await create_job(kapi, env.namespace, doc)

        # 1. The Workload: Kueue's name, owned by the job, the queue, one pod set per role with counts and requests.
        wl_name = kueue.workload_name("kq", job["metadata"]["uid"])
        wl = await kq.wait(wl_name, lambda w: True, "created")
        assert [w["metadata"]["name"] for w in await kq.workloads()] == [wl_name]
        assert wl_name.startswith("trainingjob-kq-") and len(wl_name) == len("trainingjob-kq-") + 5
        assert wl["spec"]["queueName"] == "team-a"
        assert wl["metadata"]["labels"][kueue.JOB_UID_LABEL] == job["metadata"]["uid"]
        assert wl["metadata"]["ownerReferences"] == [
            {"apiVersion": "rlkube.io/v1alpha1", "kind": "TrainingJob", "name": "kq", "uid": job["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}
        ]
        sets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
        assert list(sets) == ["redis", "trainer", "inference", "preprocessor", "actor"]
        assert {n: ps["count"] for n, ps in sets.items()} == {n: 1 for n in sets}
        trainer_res = sets["trainer"]["template"]["spec"]["containers"][0]["resources"]
        assert trainer_res["requests"] == doc["spec"]["trainer"]["resources"]["requests"]
        assert sets["inference"]["template"]["spec"]["containers"][0]["resources"]["requests"] == (
            doc["spec"]["inference"]["resources"]["requests"])

        # 2. Gated: Suspended while not admitted, and not one pod (several passes later).
        status = await env.recorder.wait_phase("kq", "Suspended", timeout=60)
        assert status["reason"] == "WaitingForAdmission" and "team-a" in status["message"]
        passes = await env.operator.passes("kq")
        await custom.patch_namespaced_custom_object(  # one more pass, to see that it still creates nothing
            "rlkube.io", "v1alpha1", env.namespace, "trainingjobs", "kq",
            {"metadata": {"annotations": {"test/touch": "1"}}}, _content_type="application/merge-patch+json")
        await env.operator.wait_passes("kq", passes + 1)
        assert await _pods(kapi, env.namespace, "kq") == {}
        assert env.kubelet.job_pods("kq") == []

        # 3. Admitted: trainer and inference get the GPU flavour's node labels and toleration, the rest nothing.
        flavors = {ps: {"cpu": default, "memory": default} for ps in sets}
        for ps in ("trainer", "inference"):
            flavors[ps] = {"cpu": default, "memory": default, "nvidia.com/gpu": gpu}
        await kq.admit(wl, "cq-a", flavors)
        await env.recorder.wait(lambda: env.recorder.phases["kq"][-1] == "Running", 60, "Running after admission")
        pods = await _pods(kapi, env.namespace, "kq")
        assert set(pods) == {"kq-redis", "kq-trainer-0", "kq-inference-0", "kq-preprocessor-0", "kq-actor-0"}
        for name in ("kq-trainer-0", "kq-inference-0"):
            assert pods[name]["spec"]["nodeSelector"] == gpu_labels, name
            assert GPU_TOLERATION in pods[name]["spec"]["tolerations"], name
        for name in ("kq-redis", "kq-preprocessor-0", "kq-actor-0"):
            # (the API server's DefaultTolerationSeconds plugin adds not-ready/unreachable tolerations to every pod)
            assert not pods[name]["spec"].get("nodeSelector"), name
            assert GPU_TOLERATION not in pods[name]["spec"]["tolerations"], name

        trainer = await env.trainer("kq")
        await trainer.weights_ready(2, documents_seen=64)
        await trainer.checkpoint_saved(2, "/checkpoints/step-2")
        await env.recorder.wait(
            lambda: (env.recorder.status("kq")["trainer"].get("lastCheckpoint") or {}).get("step") == 2, 20,
            "checkpoint step 2 in status")

        # 4. Evicted: the ordered suspend, then the admission given back to Kueue.
        first = env.kubelet.job_pods("kq")
        wl = await kq.get(wl_name)
        await kq.evict(wl, "Preempted", "Preempted to accommodate a higher priority Workload")
        await env.recorder.wait(
            lambda: env.recorder.status("kq").get("phase") == "Suspended"
            and _cond_of(env.recorder.latest["kq"], "Suspended").get("status") == "True", 60, "Suspended by eviction")
        suspended = env.recorder.status("kq")
        assert suspended["reason"] == "Evicted" and "Preempted" in suspended["message"]
        assert suspended["teardown"]["reason"] == "Suspended" and suspended["teardown"]["stage"] == "Done"
        assert [s["name"] for s in suspended["teardown"]["stages"]] == list(TEARDOWN_ORDER)
        assert all(p.gone_seq for p in first)
        by_role = {r: [p for p in first if p.role == r] for r in specs.POD_ORDER}
        for a, b in pairwise(specs.POD_ORDER):
            assert max(p.gone_seq for p in by_role[a]) < min(p.deleting_seq for p in by_role[b]), (a, b)
        assert await _pods(kapi, env.namespace, "kq") == {}
        wl = await kq.wait(wl_name, lambda w: not (w.get("status") or {}).get("admission"), "admission cleared")
        assert _cond_of(wl, kueue.QUOTA_RESERVED)["status"] == "False"
        assert _cond_of(wl, kueue.ADMITTED)["status"] == "False"
        assert _cond_of(wl, kueue.REQUEUED) == {**_cond_of(wl, kueue.REQUEUED), "status": "True", "reason": "Preempted"}
        assert _cond_of(wl, kueue.EVICTED)["status"] == "True"

        # 5. Re-admitted: resumed, the trainer from its checkpoint, placed again.
        await kq.admit(wl, "cq-a", flavors)
        await env.recorder.wait(
            lambda: env.recorder.phases["kq"][-1] == "Running" and env.recorder.phases["kq"].count("Running") == 2,
            60, "Running again after re-admission")
        pods = await _pods(kapi, env.namespace, "kq")
        t0 = pods["kq-trainer-0"]
        assert t0["metadata"]["uid"] not in {p.uid for p in first}
        assert t0["metadata"]["annotations"][names.ANNOTATION_RESUME] == "/checkpoints/step-2"
        assert t0["spec"]["nodeSelector"] == gpu_labels

        # 6. Finished: the job succeeds, its Workload is marked Finished (reason Succeeded).
        trainer = await env.trainer("kq")
        await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
        await env.kubelet.exit("kq-trainer-0", 0)
        await env.recorder.wait_phase("kq", "Succeeded", timeout=60)
        wl = await kq.wait(wl_name, lambda w: _cond_of(w, kueue.FINISHED).get("status") == "True", "Finished")
        assert _cond_of(wl, kueue.FINISHED)["reason"] == "Succeeded"
        assert env.recorder.phases["kq"] == [
            "Suspended", "Pending", "Starting", "Running", "Suspended", "Pending", "Starting", "Running", "Draining",
            "Succeeded"]
    finally:
        for name in (gpu, default):
            await custom.delete_cluster_custom_object(kueue.GROUP, kueue.VERSION, "resourceflavors", name)
