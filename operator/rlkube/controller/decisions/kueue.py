"""Kueue integration, pure: the Workload a queued TrainingJob asks Kueue to admit, and what its status means.

A TrainingJob labelled `kueue.x-k8s.io/queue-name` is held (it behaves as suspended, stopping.py) until the
Workload built here is admitted; the admitted flavours' node labels and tolerations are merged into its pods
(placement.py); an eviction holds it again (the ordered suspend). The operator plays the part of Kueue's job
integration (kueue pkg/controller/jobframework/reconciler.go) for its own kind; Kueue's scheduler admits.

Taken from kubernetes-sigs/kueue ff69552e (v0.20.0-devel; API kueue.x-k8s.io/v1beta2, the storage version
since v0.15; Kueue <= 0.14 serves only v1beta1, whose fields used here are the same):
- Workload: name `trainingjob-{name}-{sha1(kind, group, name, uid)[:5]}` (jobframework/workload_names.go),
  a controller owner reference to the job, `spec.queueName` from the job's queue-name label, label
  `kueue.x-k8s.io/job-uid`, one pod set per role: name, count, template (jobframework ConstructWorkload).
- Admitted = condition Admitted=True; evicted = Evicted=True (workload_types.go constants).
- Placement: every distinct flavour of a pod set's assignment is read; its `spec.nodeLabels` go into the pod's
  nodeSelector and its `spec.tolerations` are appended (pkg/podset FromAssignment).
- Finished: condition Finished=True, reason Succeeded or Failed, once the job has finished (workload/finish).
- After an eviction, once the job's pods are gone, the integration clears the admission: status.admission
  removed, QuotaReserved=False (reason Pending), Admitted=False (NoReservation), Requeued (True only for
  Preempted and NodeFailures evictions); Kueue's scheduler then admits it again (reconciler.go step 6).
Not done: Kueue's `kueue.x-k8s.io/resource-in-use` finalizer (only a running Kueue would remove it), priority
classes, admission checks' podSetUpdates, topology-aware scheduling, partial admission (assignment counts).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlkube.api.status import Phase
from rlkube.controller.decisions.actions import Action, Create, PatchWorkloadStatus
from rlkube.controller.decisions.times import fmt_time
from rlkube.controller.manifests import builders, names
from rlkube.controller.manifests.placement import Placement
from rlkube.lifecycle.phases import ConditionStatus
from rlkube.lifecycle.roles import START_ORDER, replicas

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"

ADMITTED = "Admitted"
QUOTA_RESERVED = "QuotaReserved"
EVICTED = "Evicted"
FINISHED = "Finished"
REQUEUED = "Requeued"
REQUEUE_ON = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue's integrations set Requeued=True (reconciler.go)."""

_HASH_LENGTH = 5
_MAX_PREFIX = 253 - 1 - _HASH_LENGTH


def queue_name(labels: Mapping[str, str] | None) -> str | None:
    return (labels or {}).get(QUEUE_LABEL) or None


def workload_name(job: str, uid: str) -> str:
    """Kueue's name for the Workload of an owner (GetWorkloadNameForOwnerWithGVK, long names)."""
    digest = hashlib.sha1(f"{names.KIND}\n{names.API_VERSION.split('/')[0]}\n{job}\n{uid}".encode()).hexdigest()
    return f"{(names.KIND.lower() + '-' + job)[:_MAX_PREFIX]}-{digest[:_HASH_LENGTH]}"


def pod_set(job: builders.JobRef, role: str) -> dict:
    """One pod set: the role's pod as the builders make it (requests, selectors), before any admission."""
    pod = builders.pod(job, role, 0)
    meta = pod["metadata"]
    template_meta = {k: meta[k] for k in ("labels", "annotations") if meta.get(k)}
    template = {"metadata": template_meta, "spec": pod["spec"]}
    return {"name": role, "count": replicas(job.spec, role), "template": template}


def workload(job: builders.JobRef, queue: str) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job.name, job.uid),
            "namespace": job.namespace,
            "labels": {**names.job_labels(job.name), JOB_UID_LABEL: job.uid},
            "ownerReferences": [names.owner_reference(job.name, job.uid)],
        },
        "spec": {
            "queueName": queue,
            "podSets": [pod_set(job, role) for role in START_ORDER if replicas(job.spec, role) > 0],
        },
    }


# -- what Kueue said ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadView:
    name: str
    resource_version: str
    generation: int
    conditions: tuple[dict[str, Any], ...] = ()
    cluster_queue: str | None = None
    flavors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Pod set name -> the distinct flavours its assignment names, in resource order."""
    has_admission: bool = False

    def condition(self, type_: str) -> dict[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == type_), None)

    def true(self, type_: str) -> bool:
        return (self.condition(type_) or {}).get("status") == ConditionStatus.TRUE

    @property
    def admitted(self) -> bool:
        return self.true(ADMITTED)

    @property
    def evicted(self) -> bool:
        return self.true(EVICTED)

    @property
    def finished(self) -> bool:
        return self.true(FINISHED)

    @property
    def quota_reserved(self) -> bool:
        return self.true(QUOTA_RESERVED)


def workload_view(obj: Mapping[str, Any]) -> WorkloadView:
    meta = obj.get("metadata") or {}
    status = obj.get("status") or {}
    admission = status.get("admission") or {}
    flavors: dict[str, tuple[str, ...]] = {}
    for assignment in admission.get("podSetAssignments") or []:
        seen: list[str] = []
        for _resource, flavor in sorted((assignment.get("flavors") or {}).items()):
            if flavor not in seen:
                seen.append(flavor)
        flavors[assignment.get("name", "")] = tuple(seen)
    return WorkloadView(
        name=meta.get("name", ""),
        resource_version=str(meta.get("resourceVersion", "")),
        generation=int(meta.get("generation") or 0),
        conditions=tuple(dict(c) for c in status.get("conditions") or []),
        cluster_queue=admission.get("clusterQueue"),
        flavors=flavors,
        has_admission=bool(admission),
    )


def flavor_placement(obj: Mapping[str, Any]) -> Placement:
    """A ResourceFlavor's node labels and tolerations."""
    spec = obj.get("spec") or {}
    return Placement(dict(spec.get("nodeLabels") or {}), tuple(dict(t) for t in spec.get("tolerations") or []))


@dataclass(frozen=True)
class KueueObserved:
    """A queued job's Kueue side, as one pass sees it (None in Observed when the job has no queue label)."""

    queue: str
    workload: WorkloadView | None = None
    flavors: Mapping[str, Placement] = field(default_factory=dict)
    """The ResourceFlavors the admission names, by name (read by the loop once the Workload is admitted)."""


def placements(wl: WorkloadView, flavors: Mapping[str, Placement]) -> dict[str, Placement]:
    """Role -> what its admitted flavours add to its pods (flavours merged in assignment order)."""
    out: dict[str, Placement] = {}
    for role, flavor_names in wl.flavors.items():
        selector: dict[str, str] = {}
        tolerations: list[dict] = []
        for name in flavor_names:
            flavor = flavors.get(name) or Placement()
            selector.update(flavor.node_selector)
            tolerations += flavor.tolerations
        out[role] = Placement(selector, tuple(tolerations))
    return out


# -- the gate -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """Whether Kueue holds the job this pass, why, and where its pods go when it does not."""

    hold: bool = False
    reason: str = ""
    message: str = ""
    placements: Mapping[str, Placement] = field(default_factory=dict)
    actions: tuple[Action, ...] = ()


OPEN = Gate()
WAITING_FOR_ADMISSION = "WaitingForAdmission"


def gate(job: builders.JobRef | None, kobs: KueueObserved | None, settled: bool) -> Gate:
    """The Kueue gate of one pass. `settled`: the job is being deleted or its outcome is decided (no Workload
    is created for it any more)."""
    if kobs is None or job is None:
        return OPEN
    wl = kobs.workload
    if wl is None:
        if settled:
            return OPEN
        return Gate(True, WAITING_FOR_ADMISSION, f"waiting for Kueue to admit it (queue {kobs.queue})",
                     actions=(Create(workload(job, kobs.queue)),))
    if wl.finished:
        return OPEN
    if wl.evicted:
        cond = wl.condition(EVICTED) or {}
        return Gate(True, EVICTED, f"Kueue evicted Workload {wl.name} ({cond.get('reason')}: {cond.get('message')})")
    if not wl.admitted:
        return Gate(True, WAITING_FOR_ADMISSION, f"waiting for Kueue to admit Workload {wl.name} (queue {kobs.queue})")
    return Gate(placements=placements(wl, kobs.flavors), reason=ADMITTED,
                message=f"admitted by ClusterQueue {wl.cluster_queue}")


def _conditions(wl: WorkloadView, updates: list[dict], now: datetime) -> list[dict]:
    """`wl`'s conditions with `updates` set (metav1 SetStatusCondition: the time moves only on a transition)."""
    out = [dict(c) for c in wl.conditions]
    for new in updates:
        new = {**new, "observedGeneration": wl.generation, "lastTransitionTime": fmt_time(now)}
        current = next((c for c in out if c["type"] == new["type"]), None)
        if current is None:
            out.append(new)
        else:
            if current.get("status") == new["status"]:
                new["lastTransitionTime"] = current.get("lastTransitionTime", new["lastTransitionTime"])
            current.update(new)
    return out


def release_actions(
    kobs: KueueObserved | None, phase: Phase, released: bool, message: str, now: datetime
) -> list[Action]:
    """What the job tells Kueue at the end of a pass: Finished when it has finished and released everything;
    after an eviction's ordered stop, the admission given back so Kueue can admit it again."""
    wl = kobs.workload if kobs is not None else None
    if wl is None or not released or wl.finished:
        return []
    if phase in Phase.TERMINAL:
        cond = {"type": FINISHED, "status": ConditionStatus.TRUE, "reason": phase,
                "message": message or f"TrainingJob {phase}"}
        return [PatchWorkloadStatus(wl.name, wl.resource_version, {"conditions": _conditions(wl, [cond], now)})]
    if phase == Phase.SUSPENDED and wl.evicted and (wl.quota_reserved or wl.has_admission):
        evicted = wl.condition(EVICTED) or {}
        why = evicted.get("message") or ""
        updates = [
            {"type": REQUEUED,
             "status": ConditionStatus.TRUE if evicted.get("reason") in REQUEUE_ON else ConditionStatus.FALSE,
             "reason": evicted.get("reason") or EVICTED, "message": why},
            {"type": QUOTA_RESERVED, "status": ConditionStatus.FALSE, "reason": "Pending", "message": why},
            {"type": ADMITTED, "status": ConditionStatus.FALSE, "reason": "NoReservation",
             "message": "The workload has no reservation"},
        ]
        return [PatchWorkloadStatus(wl.name, wl.resource_version,
                                    {"conditions": _conditions(wl, updates, now), "admission": None})]
    return []
