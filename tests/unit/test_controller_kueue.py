"""The Kueue integration's pure parts: the Workload built for a job, the gate, placement, and what is patched back.

The Workload is also checked against Kueue's own (trimmed) CRD schema in tests/fixtures/kueue: required
fields, pod set names, counts and the 8-pod-set limit.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import yaml
from rlkube.controller.decisions import kueue
from rlkube.controller.manifests import builders
from rlkube.controller.decisions.actions import Create, PatchWorkloadStatus
from rlkube.controller.decisions.recipe import decide
from rlkube.controller.decisions.observed import Observed
from rlkube.controller.manifests.placement import Placement, with_placement
from rlkube.lifecycle.phases import Phase
from test_controller_decisions import T0, all_pods, job

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kueue"
GPU = Placement({"accelerator": "a100"}, ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},))


def _schema(kind: str) -> dict:
    crd = yaml.safe_load((FIXTURES / f"kueue.x-k8s.io_{kind}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    assert version["name"] == kueue.VERSION and version["storage"] and "status" in version["subresources"]
    return version["schema"]["openAPIV3Schema"]


def _cond(type_: str, status: str = "True", reason: str = "R", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2026-01-01T00:00:00Z"}


def _wl(*conds: dict, flavors: dict | None = None) -> kueue.WorkloadView:
    obj: dict = {"metadata": {"name": "wl", "resourceVersion": "7", "generation": 1},
                 "status": {"conditions": list(conds)}}
    if flavors is not None:
        obj["status"]["admission"] = {"clusterQueue": "cq", "podSetAssignments": [
            {"name": n, "flavors": f, "count": 1} for n, f in flavors.items()]}
    return kueue.workload_view(obj)


ADMITTED = (_cond("QuotaReserved"), _cond("Admitted"))


def test_workload_matches_kueue_schema_and_the_spec():
    j = job()
    wl = kueue.workload(j.ref, "team-a")
    jsonschema.validate(wl, _schema("workloads"))
    assert wl["metadata"]["name"] == kueue.workload_name("j", "uid-j")
    assert wl["metadata"]["ownerReferences"][0]["kind"] == "TrainingJob"
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    assert wl["spec"]["queueName"] == "team-a"
    sets = {ps["name"]: ps for ps in wl["spec"]["podSets"]}
    assert list(sets) == ["redis", "trainer", "inference", "preprocessor", "actor"]
    # The templates are the pods the builders make: the same containers and requests.
    assert sets["trainer"]["template"]["spec"] == builders.pod(j.ref, "trainer", 0)["spec"]


def test_pod_set_counts_follow_replicas_and_external_redis_has_none():
    j = job(**{"trainer.nodes": 2, "actor.replicas": 3, "redis.mode": "external", "redis.url": "redis://r:6379/0"})
    sets = {ps["name"]: ps["count"] for ps in kueue.workload(j.ref, "q")["spec"]["podSets"]}
    assert sets == {"trainer": 2, "inference": 1, "preprocessor": 1, "actor": 3}


def test_workload_name_is_kueues_format():
    name = kueue.workload_name("my-job", "1234")
    assert name.startswith("trainingjob-my-job-") and len(name.rsplit("-", 1)[1]) == 5
    assert name != kueue.workload_name("my-job", "5678")  # the uid is in the hash
    assert len(kueue.workload_name("x" * 300, "u")) == 253


def test_gate_creates_the_workload_then_holds_until_admitted():
    j = job()
    g = kueue.gate(j.ref, kueue.KueueObserved("q"), settled=False)
    assert g.hold and g.reason == kueue.WAITING_FOR_ADMISSION
    assert [a.kind for a in g.actions if isinstance(a, Create)] == ["Workload"]
    assert kueue.gate(j.ref, kueue.KueueObserved("q"), settled=True) == kueue.OPEN
    assert kueue.gate(j.ref, None, settled=False) == kueue.OPEN
    pending = kueue.gate(j.ref, kueue.KueueObserved("q", _wl(_cond("QuotaReserved", "False"))), False)
    assert pending.hold and not pending.actions
    reserved_only = kueue.gate(j.ref, kueue.KueueObserved("q", _wl(_cond("QuotaReserved"))), False)
    assert reserved_only.hold  # quota without Admitted (admission checks pending) is not enough
    evicted = kueue.gate(j.ref, kueue.KueueObserved("q", _wl(*ADMITTED, _cond("Evicted", reason="Preempted"))), False)
    assert evicted.hold and evicted.reason == "Evicted" and "Preempted" in evicted.message


def test_admitted_flavours_place_each_role():
    wl = _wl(*ADMITTED, flavors={"trainer": {"cpu": "default", "nvidia.com/gpu": "gpu"}, "actor": {"cpu": "default"}})
    flavors = {"gpu": GPU, "default": Placement({"zone": "a"})}
    g = kueue.gate(job().ref, kueue.KueueObserved("q", wl, flavors), False)
    assert not g.hold
    assert g.placements["trainer"] == Placement({"zone": "a", "accelerator": "a100"}, GPU.tolerations)
    assert g.placements["actor"] == Placement({"zone": "a"})


def test_placement_merges_into_a_pod():
    pod = {"spec": {"nodeSelector": {"zone": "b", "disk": "ssd"}, "tolerations": [dict(GPU.tolerations[0])]}}
    out = with_placement(pod, Placement({"zone": "a", "accelerator": "a100"}, GPU.tolerations))
    assert out["spec"]["nodeSelector"] == {"zone": "a", "disk": "ssd", "accelerator": "a100"}
    assert out["spec"]["tolerations"] == list(GPU.tolerations)  # not added twice
    assert pod["spec"]["nodeSelector"]["zone"] == "b"  # the input is not changed
    assert with_placement(pod, None) is pod
    built = builders.pod(job().ref, "inference", 0, placement=GPU)
    assert built["spec"]["nodeSelector"] == GPU.node_selector and built["spec"]["tolerations"] == list(GPU.tolerations)


def test_finished_and_eviction_release_patches():
    now = datetime(2026, 1, 2, tzinfo=UTC)
    kobs = kueue.KueueObserved("q", _wl(*ADMITTED, flavors={"trainer": {"cpu": "default"}}))
    (done,) = kueue.release_actions(kobs, "Succeeded", True, "training finished", now)
    assert isinstance(done, PatchWorkloadStatus) and done.resource_version == "7"
    finished = next(c for c in done.status["conditions"] if c["type"] == "Finished")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert kueue.release_actions(kobs, "Succeeded", False, "", now) == []  # pods still running: not yet
    assert kueue.release_actions(kobs, "Suspended", True, "", now) == []  # not evicted: nothing to give back

    evicted = kueue.KueueObserved("q", _wl(*ADMITTED, _cond("Evicted", reason="Preempted", message="by wl2"),
                                            flavors={"trainer": {"cpu": "default"}}))
    (back,) = kueue.release_actions(evicted, "Suspended", True, "", now)
    conds = {c["type"]: c for c in back.status["conditions"]}
    assert back.status["admission"] is None
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    assert conds["Requeued"]["status"] == "True" and conds["Requeued"]["reason"] == "Preempted"
    assert conds["Evicted"]["status"] == "True"  # Kueue resets it when it admits again
    status_schema = _schema("workloads")["properties"]["status"]
    jsonschema.validate({"conditions": back.status["conditions"]}, status_schema)  # admission: null deletes it


def test_a_queued_job_is_suspended_with_nothing_created_until_admitted():
    obs = Observed(static_present=frozenset(), kueue=kueue.KueueObserved("q"))
    d = decide(job(), obs, T0)
    assert [a.kind for a in d.actions if isinstance(a, Create)] == ["Workload"]
    assert d.status.phase == Phase.SUSPENDED and d.status.reason == kueue.WAITING_FOR_ADMISSION
    # Admitted: resumed, and the pods carry the flavour.
    wl = _wl(*ADMITTED, flavors={r: {"cpu": "gpu"} for r in ("redis", "trainer", "inference", "preprocessor", "actor")})
    d2 = decide(job(status=d.status), Observed(kueue=kueue.KueueObserved("q", wl, {"gpu": GPU})), T0)
    pods = [a.manifest for a in d2.actions if isinstance(a, Create) and a.kind == "Pod"]
    assert d2.status.phase == Phase.PENDING and pods
    assert all(p["spec"]["nodeSelector"] == GPU.node_selector for p in pods)


def test_eviction_runs_the_ordered_suspend():
    wl = _wl(*ADMITTED, flavors={"trainer": {"cpu": "gpu"}})
    running = decide(job(), Observed(pods=tuple(all_pods()), kueue=kueue.KueueObserved("q", wl, {"gpu": GPU})), T0)
    evicted = _wl(*ADMITTED, _cond("Evicted", reason="Preempted"), flavors={"trainer": {"cpu": "gpu"}})
    d = decide(job(status=running.status), Observed(pods=tuple(all_pods()), kueue=kueue.KueueObserved("q", evicted)), T0)
    assert d.status.teardown is not None and d.status.teardown.reason == "Suspended"
    assert d.status.teardown.stage == "actor"  # the first stage of the ordered teardown
    assert d.status.phase == Phase.SUSPENDED and not any(isinstance(a, Create) for a in d.actions)
