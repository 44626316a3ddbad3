"""The per-job reconcile loop: observe -> decide -> apply -> one status patch -> Events, then sleep until woken.

A `JobLoop` exists per TrainingJob while the operator handles it. It is woken by pod events (through the
kopf pod index and watch), by the deletion of its ConfigMap, Secret or a Service (kopf indexes of those
kinds), by its Redis event watcher, by spec updates, and by the deadlines the decisions return (grace
periods, completion and stall timeouts, TTL). It never lists anything from the API server: pods and the
other children come from the kopf indexes, the job from kopf's live body, trainer events from Redis.

Index staleness is handled here, not in the decisions: children this loop created are counted as present until
the watch delivers them (so a teardown that starts right after a creation still waits for them), pods it
deleted count as deleting until the watch shows their deletionTimestamp (so a pass in between does not delete
them again), and pods it force-deleted are hidden until the watch confirms they are gone (so nothing is
counted twice).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import kopf
from redis.exceptions import RedisError

from rlkube.api.role import Role
from rlkube.api.status import ConditionType, TrainingJobStatus
from rlkube.contract import protocol, runtime
from rlkube.controller.decisions import kueue
from rlkube.controller.manifests import names
from rlkube.controller.reconcile import metrics
from rlkube.lifecycle.phases import ConditionStatus, PodPhase
from rlkube.controller.decisions.actions import (
    Create,
    DeleteJob,
    DeleteObject,
    DeletePod,
    DeleteStreams,
    PatchWorkloadStatus,
)
from rlkube.controller.reconcile.apiclient import ApiError
from rlkube.controller.reconcile.job_io import (
    COALESCE_SECONDS,
    STATUS_KEYS,
    api_message,
    describe,
    job_view,
    merge_patch,
    parse_status,
    parsed_spec,
    routine_patch,
    waves,
    without_empty_strings,
)
from rlkube.controller.decisions.recipe import Decision, JobView, decide
from rlkube.controller.reconcile.kube import Kube
from rlkube.controller.decisions.observed import (
    EventSource,
    Observed,
    PodView,
    Rejected,
    pod_view,
)
from rlkube.controller.decisions.times import now, stream_id_key
from rlkube.controller.reconcile.watcher import EventWatcher, RedisClients, Target, connect

log = logging.getLogger(__name__)

RESYNC_SECONDS = 60.0
"""Longest sleep between passes with nothing to wake them: re-derives state from the index (no API reads)."""
INFLIGHT_SECONDS = 60.0
"""How long a pod this loop created counts as present while the watch has not delivered it yet."""
PASS_TIMEOUT = 120.0
"""A pass stuck on the network longer than this is abandoned and retried (it is idempotent)."""
ERROR_BACKOFF = (0.5, 1, 2, 5, 10, 30)
Key = tuple[str, str]


@dataclass
class Shared:
    """What every job loop of this operator process shares (kept in kopf's memo)."""

    kube: Kube
    loops: dict[Key, JobLoop] = field(default_factory=dict)
    phases: dict[Key, str] = field(default_factory=dict)
    pod_index: Any = None  # kopf.Index[(namespace, job), PodView], set by the first handler call
    static_indexes: tuple = ()  # kopf.Index[(namespace, job), "Kind/name"] of ConfigMaps, Secrets, Services
    workload_index: Any = None  # kopf.Index[(namespace, job), kueue.WorkloadView] of Kueue Workloads
    redis: RedisClients = field(default_factory=RedisClients)  # the event watchers' clients, one per Redis

    def loop(self, namespace: str, name: str) -> JobLoop:
        key = (namespace, name)
        if key not in self.loops:
            self.loops[key] = JobLoop(self, namespace, name)
        return self.loops[key]

    async def forget(self, namespace: str, name: str) -> None:
        loop = self.loops.pop((namespace, name), None)
        if loop is not None:
            await loop.stop_watcher()
        self.phases.pop((namespace, name), None)
        metrics.set_phases(self.phases)
        metrics.forget_job(namespace, name)


async def _outcome(coro: Any) -> Any:
    """The coroutine's result, or the exception it raised (as asyncio.gather(return_exceptions=True) gives)."""
    try:
        return await coro
    except Exception as exc:  # noqa: BLE001 (handed back to the caller, which re-raises what it does not handle)
        return exc


class JobLoop:
    def __init__(self, shared: Shared, namespace: str, name: str):
        self.shared = shared
        self.namespace = namespace
        self.name = name
        self._wakers: set[asyncio.Event] = set()  # one per running loop (the daemon, a deletion)
        self.lock = asyncio.Lock()
        self.status: TrainingJobStatus | None = None  # what this process last decided (written, or held)
        self.written: dict | None = None
        self.flush_at: float | None = None  # monotonic deadline of a held routine status change (None: none held)
        self.static_inflight: dict[str, float] = {}  # "Kind/name" created (or found present) -> when
        self.rejected: Rejected | None = None
        self.inflight: dict[str, tuple[PodView, float]] = {}
        self.gone: set[str] = set()
        self.deleting: dict[str, tuple[int, float]] = {}  # uid -> (grace, when) of deletes the watch has not shown
        self.watcher: EventWatcher | None = None
        self._retiring: set[asyncio.Task] = set()  # watchers detached by _retire_watcher, still stopping
        self.errors = 0
        self.flavors: dict[str, tuple[str, kueue.Placement]] = {}  # ResourceFlavor name -> (workload rv, placement)
        self.trigger: tuple | None = None  # what of the object the last pass saw that a change of must wake it
        self._parsed: tuple[tuple, tuple[Any, str | None]] | None = None  # ((uid, generation), parsed_spec())

    # -- wake-ups ---------------------------------------------------------------------------------

    def pod_event(self, uid: str, event_type: str | None) -> None:
        for name, (view, _) in list(self.inflight.items()):
            if view.uid == uid:
                del self.inflight[name]
        if event_type == "DELETED":
            self.gone.discard(uid)
            self.deleting.pop(uid, None)
        self.notify()

    @staticmethod
    def _trigger(body: Any) -> tuple:
        """The parts of the object whose change needs a pass, as kopf's update handler saw them: the spec
        (generation), labels (a Kueue queue) and annotations, without kopf's own (rlkube.io/ prefix) and
        kubectl's copy of the spec. The job's own status writes change none of them, so they wake nothing."""
        meta = body.get("metadata") or {}
        annotations = {k: v for k, v in (meta.get("annotations") or {}).items()
                       if not k.startswith("rlkube.io/") and k != "kubectl.kubernetes.io/last-applied-configuration"}
        return (meta.get("generation"), tuple(sorted((meta.get("labels") or {}).items())),
                tuple(sorted(annotations.items())))

    def _parse(self, body: Any) -> tuple[Any, str | None]:
        """parsed_spec() of the body, validated once per generation (the API server bumps it on any spec change)
        rather than on every pass: at 200 jobs, re-validating an unchanged spec was a visible share of the CPU."""
        meta = body["metadata"]
        key = (meta.get("uid"), meta.get("generation"))
        if meta.get("generation") is None or self._parsed is None or self._parsed[0] != key:
            self._parsed = (key, parsed_spec(meta["name"], dict(body.get("spec") or {})))
        return self._parsed[1]

    def trigger_changed(self, body: Any) -> bool:
        """This event's object differs from what the last pass saw (or no pass has run yet)."""
        return self._trigger(body) != self.trigger

    def notify(self) -> None:
        """Something changed: every loop running for this job makes a pass."""
        for waker in self._wakers:
            waker.set()

    async def _sleep(self, wake: asyncio.Event, timeout: float, stopped: kopf.DaemonStopped | None) -> None:
        waiters = [asyncio.ensure_future(wake.wait())]
        if stopped is not None:
            waiters.append(asyncio.ensure_future(stopped.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- the loop ---------------------------------------------------------------------------------

    async def run(self, body: Any, stopped: kopf.DaemonStopped | None = None, until_released: bool = False) -> None:
        """Reconcile until the job is finished (daemon) or released (deletion), or `stopped` is set."""
        wake = asyncio.Event()
        self._wakers.add(wake)
        try:
            await self._run(wake, body, stopped, until_released)
        finally:
            self._wakers.discard(wake)

    async def _run(self, wake: asyncio.Event, body: Any, stopped: kopf.DaemonStopped | None, until_released: bool):
        while True:
            if stopped is not None and stopped:
                return
            wake.clear()
            try:
                async with asyncio.timeout(PASS_TIMEOUT):
                    decision = await self.reconcile(body)
                self.errors = 0
            except (TimeoutError, ApiError, aiohttp.ClientError, RedisError, OSError) as exc:
                delay = ERROR_BACKOFF[min(self.errors, len(ERROR_BACKOFF) - 1)]
                self.errors += 1
                log.warning("%s/%s: reconcile failed (%s); retrying in %ss", self.namespace, self.name, exc, delay)
                await self._sleep(wake, delay, stopped)
                continue
            if until_released and decision.released:
                return
            if not until_released and decision.finished:
                return
            timeout = RESYNC_SECONDS if decision.requeue_after is None else min(decision.requeue_after, RESYNC_SECONDS)
            if self.flush_at is not None:
                timeout = min(timeout, max(0.0, self.flush_at - time.monotonic()))
            # A deadline just passed: come back a moment later so `now >= deadline` holds.
            await self._sleep(wake, timeout + 0.01, stopped)

    async def reconcile(self, body: Any) -> Decision:
        async with self.lock:
            t0 = time.perf_counter()
            self.trigger = self._trigger(body)
            status = self.status if self.status is not None else parse_status(body.get("status"))
            job = job_view(body, status, self._parse(body))
            pods = self._pods()
            fresh = False
            if self.watcher is not None and self._exit_0_to_judge(job, pods):
                # Pods first, then the read: whatever made those pods stop is in the stream by now.
                fresh = await self.watcher.read_to_end()
            obs = self._observe(job, pods, fresh)
            obs = replace(obs, kueue=await self._kueue(body))
            decision = decide(job, obs, now())
            if decision.actions or decision.events:
                td = decision.status.teardown
                log.info(
                    "%s/%s: %s%s; %s",
                    self.namespace,
                    self.name,
                    decision.status.phase,
                    f" (teardown {td.reason}: {td.stage})" if td else "",
                    ", ".join(describe(a) for a in decision.actions) or "no actions",
                )
            await self._apply(job, decision)
            await self._write_status(job, body, decision)
            for ev in decision.events:
                kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message)
            await self._sync_watcher(job, decision)
            metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
            metrics.RECONCILE_PASSES.labels(self.namespace, self.name).inc()
            if decision.teardown_seconds is not None and decision.status.teardown is not None:
                metrics.TEARDOWN_SECONDS.labels(decision.status.teardown.reason or "").observe(
                    decision.teardown_seconds
                )
            self.shared.phases[(self.namespace, self.name)] = decision.status.phase
            metrics.set_phases(self.shared.phases)
            return decision

    # -- observe ----------------------------------------------------------------------------------

    @staticmethod
    def _exit_0_to_judge(job: JobView, pods: list[PodView]) -> bool:
        """A non-trainer pod exited 0 and no training_finished is recorded: the decision needs a fresh read."""
        completion = job.status.completion
        if completion is not None and completion.stream_id is not None:
            return False
        return any(p.role != Role.TRAINER and p.phase == PodPhase.SUCCEEDED and not p.deleting for p in pods)

    def _pods(self) -> list[PodView]:
        index = self.shared.pod_index
        indexed: list[PodView] = list(index.get((self.namespace, self.name), [])) if index is not None else []
        horizon = time.monotonic() - INFLIGHT_SECONDS
        pods = []
        for p in indexed:
            if p.uid in self.gone:
                continue
            if p.uid in self.deleting:
                grace, when = self.deleting[p.uid]
                if p.deleting or when < horizon:
                    del self.deleting[p.uid]  # the watch has it (or it never came: deleting it again is right)
                else:
                    p = replace(p, deleting=True, deletion_grace=grace)
            pods.append(p)
        seen = {p.name for p in pods}
        for name, (view, created) in list(self.inflight.items()):
            if created < horizon or any(p.uid == view.uid for p in indexed):
                del self.inflight[name]
            elif name not in seen:
                pods.append(view)
        return pods

    def _observe(self, job: JobView, pods: list[PodView], events_read_to_end: bool) -> Observed:
        events: tuple = ()
        read_upto = None
        source = EventSource()
        if self.watcher is not None:
            last = job.status.trainer.last_event_id
            events = tuple(self.watcher.pending(last))
            if stream_id_key(self.watcher.last_id) > stream_id_key(last):
                read_upto = self.watcher.last_id
            source = self.watcher.source
        return Observed(
            pods=tuple(pods),
            events=events,
            read_upto=read_upto,
            event_source=source,
            events_read_to_end=events_read_to_end,
            static_present=self._statics(),
            create_rejected=self.rejected,
        )

    async def _kueue(self, body: Any) -> kueue.KueueObserved | None:
        """The job's Kueue side: queue label, Workload (kopf index), and the flavours its admission names.

        Flavours are read from the API server (they are cluster-scoped and few) once per Workload version."""
        queue = kueue.queue_name(body["metadata"].get("labels"))
        if queue is None:
            return None
        index = self.shared.workload_index
        views = list(index.get((self.namespace, self.name), [])) if index is not None else []
        wl = max(views, key=lambda v: int(v.resource_version or 0), default=None)
        flavors: dict[str, kueue.Placement] = {}
        if wl is not None and wl.admitted and not wl.evicted:
            for name in sorted({f for names_ in wl.flavors.values() for f in names_}):
                cached = self.flavors.get(name)
                if cached is None or cached[0] != wl.resource_version:
                    obj = await self.shared.kube.read_resource_flavor(name)
                    self.flavors[name] = (wl.resource_version, kueue.flavor_placement(obj))
                flavors[name] = self.flavors[name][1]
        return kueue.KueueObserved(queue, wl, flavors)

    def _statics(self) -> frozenset[str]:
        """ConfigMap/Secret/Services of this job: the kopf indexes, plus creations the watch has not delivered."""
        present: set[str] = set()
        for index in self.shared.static_indexes:
            present.update(index.get((self.namespace, self.name), []))
        horizon = time.monotonic() - INFLIGHT_SECONDS
        for key, created in list(self.static_inflight.items()):
            if created < horizon or key in present:
                del self.static_inflight[key]  # the index has it (a later deletion shows) or it never came
            else:
                present.add(key)
        return frozenset(present)

    # -- apply ------------------------------------------------------------------------------------

    async def _apply(self, job: JobView, decision: Decision) -> None:
        if decision.status.conditions and self.rejected is not None and any(
            c.type == ConditionType.FAILED and c.status == ConditionStatus.TRUE for c in decision.status.conditions
        ):
            self.rejected = None  # recorded as the outcome (written below with this decision's status)
        # Consecutive actions of one kind go to the API server together (the ConfigMap, Secret and Services of a
        # new job, then its first pods; the pods of one teardown stage): one round trip per wave, not per child,
        # which is most of a pass under load. The waves keep the decisions' order between kinds: statics exist
        # before the pods that mount them, and nothing after a rejected child is created.
        for wave in waves(decision.actions):
            if not await self._apply_wave(job, wave):
                return

    async def _apply_wave(self, job: JobView, wave: list[Any]) -> bool:
        """Apply actions of one kind concurrently; False when the API server rejected a child (stop there)."""
        if len(wave) == 1:
            results: list[Any] = [await _outcome(self._apply_one(job, wave[0]))]
        else:
            results = await asyncio.gather(*(self._apply_one(job, a) for a in wave), return_exceptions=True)
        rejected = None
        for action, result in zip(wave, results, strict=True):
            if isinstance(result, ApiError) and isinstance(action, Create) and result.status in (400, 422):
                rejected = rejected or Rejected(action.kind, action.name, api_message(result))
            elif isinstance(result, BaseException):
                raise result  # what went through is recorded (by _apply_one); the next pass retries the rest
        if rejected is not None:
            # Invalid, not transient: no retry; the next pass (at once) fails the job and tears down.
            self.rejected = rejected
            log.error("%s/%s: %s/%s rejected: %s", self.namespace, self.name, rejected.kind, rejected.name,
                      rejected.message)
            self.notify()
            return False
        return True

    async def _apply_one(self, job: JobView, action: Any) -> None:
        kube = self.shared.kube
        if isinstance(action, Create):
            # The one place a secret is minted: for the Secret this action creates (not on every pass).
            manifest = action.minted(secrets.token_urlsafe(24)) if action.mint is not None else action.manifest
            created = await kube.create(self.namespace, manifest)
            if action.kind == "Pod":
                if created is not None:
                    view = pod_view(created)
                    if view is not None:
                        self.inflight[action.name] = (view, time.monotonic())
            else:
                self.static_inflight[f"{action.kind}/{action.name}"] = time.monotonic()
        elif isinstance(action, DeletePod):
            deleted = await kube.delete_pod(self.namespace, action.name, action.uid, action.grace_seconds)
            if action.grace_seconds == 0 or not deleted:
                self.gone.add(action.uid)  # grace 0 removes it at once; 404/409: it is already gone
            else:
                self.deleting[action.uid] = (action.grace_seconds, time.monotonic())
            if action.force and deleted:
                metrics.FORCE_DELETIONS.labels(action.role).inc()
        elif isinstance(action, DeleteObject):
            await kube.delete_object(self.namespace, action.kind, action.name)
            self.static_inflight.pop(f"{action.kind}/{action.name}", None)
        elif isinstance(action, DeleteStreams):
            await self._delete_streams(job, action.keys)
        elif isinstance(action, DeleteJob):
            await kube.delete_job(self.namespace, self.name)
        elif isinstance(action, PatchWorkloadStatus):
            await kube.patch_workload_status(self.namespace, action.name, action.resource_version, action.status)

    async def _delete_streams(self, job: JobView, keys: tuple[str, ...]) -> None:
        target = await self._external_target(job)
        if target is None:
            return
        client = connect(target, 3)
        try:
            await client.delete(*keys)
        finally:
            await client.aclose()

    async def _write_status(self, job: JobView, body: Any, decision: Decision) -> None:
        doc = without_empty_strings(decision.status.model_dump(by_alias=True, mode="json", exclude_none=True))
        if self.written is None:
            stored = body.get("status")
            self.written = {k: v for k, v in stored.items() if k in STATUS_KEYS} if isinstance(stored, dict) else {}
        patch = merge_patch(self.written, doc)
        if patch and routine_patch(patch, decision):
            if self.flush_at is None:
                self.flush_at = time.monotonic() + COALESCE_SECONDS
            if time.monotonic() < self.flush_at:
                self.status = decision.status  # held: the next pass starts from it and writes it
                return
        if patch:
            await self.shared.kube.patch_status(self.namespace, self.name, patch)
            self.written = doc
        self.status = decision.status
        self.flush_at = None
        metrics.JOBS.observe(self.namespace, self.name, decision.status)  # what the API server now holds
        if self.watcher is not None:
            self.watcher.commit(decision.status.trainer.last_event_id)

    # -- the event watcher --------------------------------------------------------------------------

    async def _sync_watcher(self, job: JobView, decision: Decision) -> None:
        target = await self._target(job) if decision.watch_events else None
        if self.watcher is not None and (target is None or self.watcher.target != target):
            self._retire_watcher()
        if target is not None and self.watcher is None:
            start = decision.status.trainer.last_event_id
            self.watcher = EventWatcher(target, start, self.notify, self.shared.redis).start()

    def _retire_watcher(self) -> None:
        """Detach the watcher and stop it in the background: its stop can wait up to watcher.STOP_TIMEOUT for a
        cancelled XREAD, and a pass (a teardown stage, at scale many of them) must not wait for that; nothing of
        a detached watcher is read again."""
        old, self.watcher = self.watcher, None
        if old is not None:
            task = asyncio.create_task(old.stop(), name=f"stop events {old.target.stream}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def stop_watcher(self) -> None:
        """Stop the watcher and wait for it and any retired one (the job is forgotten or the operator stops)."""
        self._retire_watcher()
        if self._retiring:
            await asyncio.wait(set(self._retiring))

    async def _target(self, job: JobView) -> Target | None:
        spec = job.spec
        if spec is None:
            return None
        if spec.redis.mode == "external":
            return await self._external_target(job)
        # Managed: the Redis pod's IP (not the Service name) so the operator needs no cluster DNS.
        index = self.shared.pod_index
        pods = list(index.get((self.namespace, self.name), [])) if index is not None else []
        redis = next((p for p in pods if p.role == Role.REDIS and p.running and p.pod_ip), None)
        if redis is None:
            return None
        if self.watcher is not None and self.watcher.target.url.startswith(f"redis://{redis.pod_ip}:"):
            return self.watcher.target  # same pod: keep the password already read
        password = await self.shared.kube.read_secret_key(self.namespace, names.secret_name(self.name), "password")
        if password is None:
            return None
        stream = protocol.StreamKeys.for_job(self.namespace, self.name, spec.trainer.backend).events
        return Target(f"redis://{redis.pod_ip}:{runtime.REDIS_PORT}/0", password, stream)

    async def _external_target(self, job: JobView) -> Target | None:
        spec = job.spec
        if spec is None or not spec.redis.url:
            return None
        if self.watcher is not None and self.watcher.target.url == spec.redis.url:
            return self.watcher.target  # the password Secret was read when this watcher started
        password = None
        ref = spec.redis.password_secret
        if ref is not None:
            password = await self.shared.kube.read_secret_key(self.namespace, ref.name, ref.key)
        stream = protocol.StreamKeys.for_job(self.namespace, self.name, spec.trainer.backend).events
        return Target(spec.redis.url, password, stream)
