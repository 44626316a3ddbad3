"""The kopf handlers: thin entry points that hand every TrainingJob to its reconcile loop (loop.py).

- `job-loop` (daemon, one per TrainingJob): runs the job's reconcile loop until the job is finished. kopf starts
  it for a new object and for every object found at start-up, and its first pass reads the object as it is.
- `job-event` (every TrainingJob event): wakes that loop when the spec or labels changed since its last pass
  (`runPolicy.suspend`, a Kueue queue label); the job's own status writes wake nothing. When the object is
  finally removed, it forgets the job (watcher, metrics).
- `job-delete`: holds kopf's finalizer (`rlkube.io/teardown`) while the ordered teardown runs; an operator
  restarted mid-deletion calls it again and the teardown resumes from `status.teardown`.
- `pods_by_job` (index) + `pod-changed` (event): the job's pods come from kopf's pod watch, and every pod
  change wakes its job. Nothing polls the API server.
- `configmaps_by_job`, `secrets_by_job`, `services_by_job`, `networkpolicies_by_job` (indexes) + `*-deleted`
  (events): the job's other children, watched the same way; a deletion wakes the job, whose next pass recreates
  what is missing.
- `workloads_by_job` (index) + `workload-changed` (event): the Kueue Workloads of queued jobs (by our labels),
  watched the same way; any change (admission, eviction) wakes the job. Where Kueue's CRD is not installed,
  kopf finds no such resource and serves these handlers nothing.

Handlers return None: kopf would store return values in the status.
Registered into an explicit registry by `build_registry()`, never as an import side effect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import kopf

from rlkube.api.spec import GROUP, PLURAL, VERSION
from rlkube.controller.decisions import kueue
from rlkube.controller.manifests import names
from rlkube.controller.process import memtrim, watchdecode
from rlkube.controller.reconcile.apiclient import ApiClient, bounded_session, load_credentials
from rlkube.controller.reconcile.kube import Kube
from rlkube.controller.reconcile.loop import Shared
from rlkube.controller.decisions.observed import PodView, pod_view

FINALIZER = "rlkube.io/teardown"
IDLE_WORKER_SECONDS = 0.5
WATCH_SERVER_TIMEOUT = 120
"""Server-side watch timeout: the API server ends each watch after this long and kopf starts a new one, so a
silently dead connection never stops the handlers (a known failure of long-lived watches, which kopf's
`settings.watching.server_timeout` exists to bound)."""
WATCH_CLIENT_TIMEOUT = 150
REQUEST_TIMEOUT = 60

MANAGED = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
MANAGED_SELECTOR = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"


REQUEST_CONNECTIONS = 32
"""Connections kopf may hold for its requests (finalizer and annotation patches, Events), beside its watches."""
WATCHES_PER_SCOPE = len(("trainingjobs", "pods", "configmaps", "secrets", "services", "networkpolicies", "workloads"))
NAMESPACE_PATTERN_CHARS = "!*?,"
"""What makes kopf read a --namespace as a pattern (globs, negations, lists: kopf's references.py)."""
WATCHES_EXTRA = 4
"""kopf's own watches besides ours: the peering object, CRDs and namespaces (for its resource discovery)."""


def kopf_connection_limit(namespaces: Sequence[str]) -> int:
    """How many connections kopf's session may open: every watch holds one for as long as it runs, so the bound is
    the requests' share plus one per watch. 0 (no bound, kopf's default) where a namespace is a pattern: the
    number of namespaces it matches, and so of watches, is known only at run time, and a bound below the watches
    would leave no connection for any request."""
    if any(kopf_pattern in ns for ns in namespaces for kopf_pattern in NAMESPACE_PATTERN_CHARS):
        return 0
    return REQUEST_CONNECTIONS + WATCHES_PER_SCOPE * max(1, len(namespaces)) + WATCHES_EXTRA


def login_handler(connection_limit: int):
    """kopf's login with the credentials the operator's own calls use (apiclient.load_credentials: the service
    account, else the kubeconfig; read again whenever kopf logs in again after a 401), with kopf's session built
    around a bounded connector. kopf's own session has no bound: at 1000 jobs created at once it opened ~190
    connections to the API server, each with asyncio's 256 KiB TLS read buffer (~48 MB of the operator's RSS), and
    more concurrent requests than a loaded API server serves any sooner. Requests beyond the bound wait in the
    connector's queue."""

    async def login(**kwargs: Any) -> kopf.ConnectionInfo | kopf.AiohttpSession | None:
        info = load_credentials()
        if connection_limit <= 0:
            return info
        return kopf.AiohttpSession(
            server=info.server,
            default_namespace=info.default_namespace,
            expiration=info.expiration,
            priority=info.priority,
            aiohttp_session=bounded_session(info, connection_limit, headers=info.as_http_headers()),
        )

    return login


class NoDiffBaseStorage(kopf.DiffBaseStorage):
    """No diff-base: every TrainingJob event is a no-op for kopf's change detection.

    kopf's on.create/on.update/on.resume handlers need the last handled "essence" of each object, stored in an
    annotation: one more PATCH of the whole TrainingJob per creation (after the finalizer's), and an essence
    built by copying the object on every watch event. The job loop needs neither: it reads the live body on
    every pass and compares the spec with status.startedSpec itself, and `job_event` wakes it on a change. So
    kopf sees the same constant essence before and after every event (NOOP), stores nothing, and still runs
    the deletion handler (a deletion is detected from deletionTimestamp, not from the essence).
    """

    ESSENCE = kopf.BodyEssence({"rlkube.io": "reconciled by the job loop"})

    def build(self, *, body: kopf.Body, extra_fields=None) -> kopf.BodyEssence:
        return self.ESSENCE

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return self.ESSENCE

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def apply_settings(settings: kopf.OperatorSettings) -> None:
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_CLIENT_TIMEOUT
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = REQUEST_TIMEOUT
    settings.networking.connect_timeout = 30
    settings.persistence.finalizer = FINALIZER
    # kopf keeps a worker per object, holding that object's last watch event, until the object has been quiet
    # this long (kopf's default: 5 s). With 1000 jobs (~8000 objects) in a burst those held events were ~30 KB a
    # job; 0.5 s lowered the operator's peak RSS by ~9 MB at no cost in latency (`rlkube bench operator -n 1000`).
    settings.queueing.idle_timeout = IDLE_WORKER_SECONDS
    # Keep kopf's bookkeeping in annotations: the status belongs to TrainingJobStatus alone.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rlkube.io")
    settings.persistence.diffbase_storage = NoDiffBaseStorage()
    # Our own Events say what happened; kopf's "Handler ... succeeded" lines would only add noise.
    settings.posting.level = logging.WARNING
    # The children are ours by label: the API server filters them (the handlers' label filters are client-side,
    # and without this every pod, ConfigMap and Secret of the cluster would be sent, decoded and held).
    for resource in CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = MANAGED_SELECTOR


async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    apply_settings(settings)
    if not watchdecode.install():
        logger.warning("kopf's watch decoding not found; watch events are decoded with the json module, untrimmed")
    memo.shared = Shared(Kube(ApiClient()))
    memo.trimmer = memtrim.start()
    logger.info("rlkube operator configured (watch timeouts %ss/%ss)", WATCH_SERVER_TIMEOUT, WATCH_CLIENT_TIMEOUT)


async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    trimmer: asyncio.Task | None = getattr(memo, "trimmer", None)
    if trimmer is not None:
        trimmer.cancel()
    shared: Shared | None = getattr(memo, "shared", None)
    if shared is None:
        return
    for loop in list(shared.loops.values()):
        await loop.stop_watcher()
    await shared.kube.api.close()


async def index_pod(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict | None:
    job = labels.get(names.LABEL_JOB)
    view = pod_view(body)
    if not job or view is None:
        return None
    return {(namespace, job): view}


async def pod_changed(
    type: str | None, body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    loop = memo.shared.loops.get((namespace, labels.get(names.LABEL_JOB)))
    if loop is not None:
        loop.pod_event(body.metadata.uid or "", type)


STATIC_KINDS = {"configmaps": "ConfigMap", "secrets": "Secret", "services": "Service",
                "networkpolicies": "NetworkPolicy"}
"""The job's children besides pods (resource -> kind); each has an index named `{resource}_by_job`."""
WORKLOADS = (kueue.GROUP, kueue.VERSION, kueue.WORKLOADS)
CHILD_RESOURCES = ("pods", *STATIC_KINDS, WORKLOADS)
"""Every watched kind but TrainingJobs: the operator's children and Kueue Workloads, all labelled MANAGED."""


def _static_indexer(kind: str):
    async def index_static(namespace: str, name: str, labels: kopf.Labels, **_: Any) -> dict | None:
        job = labels.get(names.LABEL_JOB)
        return {(namespace, job): f"{kind}/{name}"} if job else None

    return index_static


async def static_changed(type: str | None, namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A ConfigMap/Secret/Service of a job is gone (kopf updated the index first): the job's next pass sees it."""
    if type != "DELETED":
        return
    loop = memo.shared.loops.get((namespace, labels.get(names.LABEL_JOB)))
    if loop is not None:
        loop.notify()


async def index_workload(body: kopf.Body, namespace: str, labels: kopf.Labels, **_: Any) -> dict | None:
    job = labels.get(names.LABEL_JOB)
    return {(namespace, job): kueue.workload_view(body)} if job else None


async def workload_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    loop = memo.shared.loops.get((namespace, labels.get(names.LABEL_JOB)))
    if loop is not None:
        loop.notify()


def _shared(memo: kopf.Memo, pods_by_job: kopf.Index[tuple[str, str], PodView], **indexes: Any) -> Shared:
    shared: Shared = memo.shared
    shared.pod_index = pods_by_job
    shared.workload_index = indexes.get("workloads_by_job")
    shared.static_indexes = tuple(indexes[f"{r}_by_job"] for r in STATIC_KINDS if f"{r}_by_job" in indexes)
    return shared


async def job_loop(
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    pods_by_job: kopf.Index,
    namespace: str,
    name: str,
    **kwargs: Any,
) -> None:
    loop = _shared(memo, pods_by_job, **kwargs).loop(namespace, name)
    await loop.run(body, stopped=stopped)


async def job_deleted(
    body: kopf.Body, memo: kopf.Memo, pods_by_job: kopf.Index, namespace: str, name: str, **kwargs: Any
) -> None:
    shared = _shared(memo, pods_by_job, **kwargs)
    loop = shared.loop(namespace, name)
    await loop.run(body, until_released=True)
    await loop.stop_watcher()


async def job_event(
    type: str | None, body: kopf.Body, memo: kopf.Memo, pods_by_job: kopf.Index, namespace: str, name: str,
    **kwargs: Any,
) -> None:
    if type == "DELETED":
        await memo.shared.forget(namespace, name)
        return
    loop = _shared(memo, pods_by_job, **kwargs).loops.get((namespace, name))
    if loop is not None and loop.trigger_changed(body):
        loop.notify()


def build_registry(namespaces: Sequence[str] = ()) -> kopf.OperatorRegistry:
    """The handlers for an operator watching `namespaces` (none: the whole cluster)."""
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry, id="login")(login_handler(kopf_connection_limit(namespaces)))
    kopf.on.startup(registry=registry, id="configure")(configure)
    kopf.on.cleanup(registry=registry, id="shutdown")(shutdown)

    kopf.index("pods", labels=MANAGED, id="pods_by_job", registry=registry)(index_pod)
    kopf.on.event("pods", labels=MANAGED, id="pod-changed", registry=registry)(pod_changed)
    for resource, kind in STATIC_KINDS.items():
        kopf.index(resource, labels=MANAGED, id=f"{resource}_by_job", registry=registry)(_static_indexer(kind))
        kopf.on.event(resource, labels=MANAGED, id=f"{resource}-deleted", registry=registry)(static_changed)

    kopf.index(*WORKLOADS, labels=MANAGED, id="workloads_by_job", registry=registry)(index_workload)
    kopf.on.event(*WORKLOADS, labels=MANAGED, id="workload-changed", registry=registry)(workload_changed)

    job = (GROUP, VERSION, PLURAL)
    kopf.daemon(*job, id="job-loop", registry=registry)(job_loop)
    kopf.on.delete(*job, id="job-delete", registry=registry)(job_deleted)
    kopf.on.event(*job, id="job-event", registry=registry)(job_event)
    return registry
