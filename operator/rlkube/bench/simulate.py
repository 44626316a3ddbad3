"""Stand-ins for the kubelet and the trainer, for `rlkube bench operator` and the operator tests (never the operator).

The test cluster is a real kube-apiserver without kubelet or scheduler, so pods would stay Pending forever.
`FakeKubelet` plays the node for the pods of rlkube jobs in one namespace, through the API only:
- it binds each new pod to a node (so the API server applies graceful deletion, as for any scheduled pod),
  "starts" it (`on_start` hook; the managed Redis pod gets a REAL redis-server bound at its pod IP, e.g.
  127.77.x.y:6379, with the password from the job's Secret) and reports it Running and Ready;
- `exit(pod, code)` ends the main container the way the kubelet reports it for the pod's restartPolicy
  (0 -> Succeeded; non-zero -> Failed under Never, an in-place restart with restartCount+1 otherwise);
- when a pod gets a deletionTimestamp it "stops" its containers and removes the pod (a delete with grace 0,
  which is what the kubelet does once the containers are gone) after `stop_delay` seconds; pods of a
  `hold`-ed role ignore SIGTERM and stay until the operator force-deletes them;
- it records, in watch order, when each pod appeared, started deleting and was gone, so tests can check
  the teardown order from what the API server did rather than from what the operator says.

`TrainerPlayer` writes trainer events with the exact wire format (rlkube.contract.protocol encoders).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import redis.asyncio as aioredis
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.api.role import Role
from rlkube.bench.listwatch import ListWatch
from rlkube.contract import protocol, runtime
from rlkube.controller.manifests import names
from rlkube.local.redis_server import RedisServer

log = logging.getLogger(__name__)

NODE = "rlkube-fake-node"
_ip_counter = itertools.count(1)


def _k8s_time(dt: datetime | None = None) -> str:
    return (dt or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def loopback_ip() -> str:
    """A fresh loopback address per call (distinct per process), to stand in for a pod IP."""
    n = next(_ip_counter)
    return f"127.{77 + n // 250}.{os.getpid() % 250 + 1}.{n % 250 + 1}"


@dataclass
class PodRecord:
    name: str
    uid: str
    role: str
    job: str
    created_seq: int
    created_at: float
    deleting_seq: int | None = None
    deleting_at: float | None = None
    gone_seq: int | None = None
    gone_at: float | None = None


StartHook = Callable[[dict], Awaitable[str | None]]


async def checked(response: Any) -> Any:
    """kubernetes_asyncio raises for an error status only when it preloads the body: with
    `_preload_content=False` a 404, 409 or 422 comes back as a plain response."""
    if 200 <= response.status <= 299:
        return response
    body = await response.read()
    response.release()
    exc = ApiException(status=response.status, reason=response.reason)
    exc.body = body.decode(errors="replace")
    raise exc


@dataclass
class FakeKubelet:
    api: client.ApiClient
    namespace: str
    stop_delay: float = 0.05
    start_delay: float = 0.0
    held: set[tuple[str | None, str]] = field(default_factory=set)
    """(job or None for every job, role): pods that ignore SIGTERM (only a force deletion removes them)."""
    paused: set[tuple[str | None, str]] = field(default_factory=set)
    """(job or None, role): pods that are not started (stay Pending) until `resume_role`."""
    unready: set[tuple[str | None, str]] = field(default_factory=set)
    """(job or None, role): pods that run but never turn Ready."""
    redis_dir: Path | None = None

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.pods: dict[str, PodRecord] = {}  # by uid
        self.by_name: dict[str, str] = {}  # name -> uid of the latest pod with that name
        self.by_job: dict[str, list[PodRecord]] = {}  # job -> its pods, in order of appearance
        self.redis: dict[str, RedisServer] = {}  # uid -> server
        # Every server ever started, stopped again by close(): a pod's DELETED pops its server and stops it in a
        # task, which close() may cancel before the stop runs (a redis-server outlived its test that way).
        self._started_redis: list[RedisServer] = []
        self._seq = itertools.count(1)
        self._watch: ListWatch | None = None
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Condition()
        self._own_dir = self.redis_dir is None
        self.redis_dir = self.redis_dir or Path(tempfile.mkdtemp(prefix="rlkube-fake-redis-"))

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> FakeKubelet:
        selector = names.label_selector({names.LABEL_MANAGED_BY: names.MANAGED_BY})
        self._watch = await ListWatch.pods(self.api, self.namespace, self._on_event, selector).start()
        return self

    async def close(self) -> None:
        try:
            if self._watch is not None:
                await self._watch.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:
            for server in self._started_redis:  # real redis-servers: never leave one behind (stop is idempotent)
                await asyncio.to_thread(server.stop)
            self.redis.clear()
            self._started_redis.clear()
        if self._own_dir and self.redis_dir is not None:
            shutil.rmtree(self.redis_dir, ignore_errors=True)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("fake kubelet task failed: %r", task.exception())

    @staticmethod
    def _matches(rules: set[tuple[str | None, str]], job: str, role: str) -> bool:
        return (job, role) in rules or (None, role) in rules

    # -- what the watch sees ----------------------------------------------------------------------

    async def _on_event(self, type_: str, pod: dict) -> None:
        meta = pod["metadata"]
        uid, name = meta["uid"], meta["name"]
        labels = meta.get("labels") or {}
        role, job = labels.get(names.LABEL_ROLE, ""), labels.get(names.LABEL_JOB, "")
        seq = next(self._seq)
        now = time.monotonic()
        record = self.pods.get(uid)
        if record is None:
            if type_ == "DELETED":
                return
            record = self.pods[uid] = PodRecord(name, uid, role, job, seq, now)
            self.by_name[name] = uid
            self.by_job.setdefault(job, []).append(record)
            unbound = not (pod.get("spec") or {}).get("nodeName") and not meta.get("deletionTimestamp")
            if unbound and not self._matches(self.paused, job, role):
                self._spawn(self._run(pod))
        if meta.get("deletionTimestamp") and record.deleting_seq is None:
            record.deleting_seq, record.deleting_at = seq, now
            if not self._matches(self.held, job, role):
                self._spawn(self._stop(name, uid))
        if type_ == "DELETED" and record.gone_seq is None:
            record.gone_seq, record.gone_at = seq, now
            server = self.redis.pop(uid, None)
            if server is not None:
                self._spawn(asyncio.to_thread(server.stop))
        async with self._changed:
            self._changed.notify_all()

    # -- playing the node -------------------------------------------------------------------------

    async def _run(self, pod: dict) -> None:
        meta = pod["metadata"]
        name = meta["name"]
        labels = meta.get("labels") or {}
        role, job = labels.get(names.LABEL_ROLE, ""), labels.get(names.LABEL_JOB, "")
        if self.start_delay:
            await asyncio.sleep(self.start_delay)  # simulated container start time
        binding = {"metadata": {"name": name}, "target": {"apiVersion": "v1", "kind": "Node", "name": NODE}}
        # 404: deleted meanwhile; 409: bound already (a pod resumed after a pause). The reply is a Status.
        if await self._raw(self.core.create_namespaced_pod_binding, name, self.namespace, binding,
                           ignore=(404, 409)) is None:
            return
        ip = await self._start_containers(pod, role)
        ready = not self._matches(self.unready, job, role)
        await self._patch_status(name, self._running_status(pod, role, ip, ready, restarts=0))

    async def _start_containers(self, pod: dict, role: str) -> str:
        if role != Role.REDIS:
            n = next(_ip_counter)
            return f"10.244.{(n // 250) % 250}.{n % 250 + 1}"
        job = pod["metadata"]["labels"][names.LABEL_JOB]
        password = await self._secret_value(names.secret_name(job), names.SECRET_KEY)
        ip = loopback_ip()
        server = RedisServer(self.redis_dir / pod["metadata"]["uid"], password=password, host=ip,
                             port=runtime.REDIS_PORT)
        self._started_redis.append(server)
        await asyncio.to_thread(server.start)
        self.redis[pod["metadata"]["uid"]] = server
        return ip

    async def _secret_value(self, name: str, key: str) -> str | None:
        import base64

        deadline = time.monotonic() + 10
        while True:
            try:
                secret = await self.core.read_namespaced_secret(name, self.namespace)
                return base64.b64decode(secret.data[key]).decode()
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)  # the Secret is created just before the pod; a kubelet would retry too

    @staticmethod
    def _running_status(pod: dict, role: str, ip: str, ready: bool, restarts: int, last: dict | None = None) -> dict:
        now = _k8s_time()
        container = {
            "name": pod["spec"]["containers"][0]["name"],
            "image": pod["spec"]["containers"][0]["image"],
            "imageID": "",
            "containerID": f"fake://{pod['metadata']['uid']}-{restarts}",
            "ready": ready,
            "started": True,
            "restartCount": restarts,
            "state": {"running": {"startedAt": now}},
        }
        if last is not None:
            container["lastState"] = {"terminated": last}
        flag = "True" if ready else "False"
        return {
            "phase": "Running",
            "hostIP": "10.0.0.1",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "startTime": now,
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": flag, "lastTransitionTime": now},
                {"type": "Ready", "status": flag, "lastTransitionTime": now},
            ],
            "containerStatuses": [container],
        }

    async def _patch_status(self, name: str, status: dict) -> None:
        await self._raw(self.core.patch_namespaced_pod_status, name, self.namespace, {"status": status}, ignore=(404,))

    async def _read_pod(self, name: str) -> dict:
        return await self._raw(self.core.read_namespaced_pod, name, self.namespace)

    @staticmethod
    async def _raw(call: Callable[..., Awaitable[Any]], *args: Any, ignore: tuple[int, ...] = (), **kwargs: Any) -> Any:
        """The call's reply as plain JSON (None for a status in `ignore`), without the client building its model
        objects: this kubelet shares the CPU with the operator it measures, which a real node does not."""
        response = await call(*args, _preload_content=False, **kwargs)
        if response.status in ignore:
            response.release()
            return None
        response = await checked(response)
        try:
            return orjson.loads(await response.read())
        finally:
            response.release()

    async def _stop(self, name: str, uid: str) -> None:
        await asyncio.sleep(self.stop_delay)  # simulated container shutdown time after SIGTERM
        await self._raw(self.core.delete_namespaced_pod, name, self.namespace,
                        body={"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}, ignore=(404, 409))

    # -- what a test does -----------------------------------------------------------------------

    async def exit(self, pod_name: str, code: int) -> None:
        """End the main container of a running pod with `code`, as the kubelet reports it."""
        pod = await self._read_pod(pod_name)
        status = pod.get("status") or {}
        cs = (status.get("containerStatuses") or [{}])[0]
        started = ((cs.get("state") or {}).get("running") or {}).get("startedAt") or _k8s_time()
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": started, "finishedAt": _k8s_time(), "containerID": cs.get("containerID", "")}
        policy = pod["spec"].get("restartPolicy", "Always")
        role = pod["metadata"]["labels"][names.LABEL_ROLE]
        if code != 0 and policy in ("OnFailure", "Always") or code == 0 and policy == "Always":
            restarts = int(cs.get("restartCount") or 0) + 1
            body = self._running_status(pod, role, status.get("podIP", ""), True, restarts, last=terminated)
        else:
            cs = {**cs, "ready": False, "started": False, "state": {"terminated": terminated}}
            body = {
                "phase": "Succeeded" if code == 0 else "Failed",
                "conditions": [
                    {"type": "Ready", "status": "False", "lastTransitionTime": _k8s_time(), "reason": "PodCompleted"},
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": _k8s_time()},
                ],
                "containerStatuses": [cs],
            }
        await self._patch_status(pod_name, body)

    async def set_ready(self, pod_name: str, ready: bool) -> None:
        flag = "True" if ready else "False"
        pod = await self._read_pod(pod_name)
        cs = [{**c, "ready": ready} for c in (pod.get("status") or {}).get("containerStatuses") or []]
        await self._patch_status(
            pod_name,
            {
                "conditions": [
                    {"type": "Ready", "status": flag, "lastTransitionTime": _k8s_time()},
                    {"type": "ContainersReady", "status": flag, "lastTransitionTime": _k8s_time()},
                ],
                "containerStatuses": cs,
            },
        )

    async def resume_role(self, job: str | None, role: str) -> None:
        """Start the pods of a paused role (and future ones)."""
        self.paused.discard((job, role))
        pods = await self.core.list_namespaced_pod(
            self.namespace, label_selector=names.label_selector(names.role_labels(job, role) if job else
                                                                {names.LABEL_ROLE: role})
        )
        for pod in pods.items:
            if not pod.spec.node_name and not pod.metadata.deletion_timestamp:
                self._spawn(self._run(self.api.sanitize_for_serialization(pod)))

    async def release(self, job: str | None, role: str) -> None:
        """Let held pods of a role stop now (they exit on the SIGTERM they were ignoring)."""
        self.held.discard((job, role))
        for rec in list(self.pods.values()):
            if rec.role == role and (job is None or rec.job == job) and rec.deleting_seq and not rec.gone_seq:
                self._spawn(self._stop(rec.name, rec.uid))

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str = "condition") -> None:
        """Wait until `predicate()` holds over the recorded pods (re-checked on every watch event)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                raise TimeoutError(f"fake kubelet: {what} not reached in {timeout}s") from None

    def redis_server(self, job: str) -> RedisServer | None:
        """The real redis-server standing in for the job's managed Redis pod, once that pod runs."""
        for uid, server in self.redis.items():
            rec = self.pods.get(uid)
            if rec is not None and rec.job == job and rec.gone_seq is None:
                return server
        return None

    def job_pods(self, job: str) -> list[PodRecord]:
        return list(self.by_job.get(job, ()))

    def live(self, job: str) -> list[PodRecord]:
        return [r for r in self.job_pods(job) if r.gone_seq is None]


class TrainerPlayer:
    """Publishes what a trainer would on its events stream, byte for byte (protocol.py encoders)."""

    def __init__(self, redis_client: aioredis.Redis, namespace: str, job: str, backend: str = "torch"):
        self.redis = redis_client
        self.stream = protocol.StreamKeys.for_job(namespace, job, backend).events

    async def _add(self, fields: dict) -> str:
        sid = await self.redis.xadd(self.stream, fields)
        return sid.decode() if isinstance(sid, bytes) else sid

    async def weights_ready(self, step: int, documents_seen: int = 0) -> str:
        return await self._add(protocol.weights_ready(step, documents_seen))

    async def checkpoint_saved(self, step: int, path: str) -> str:
        return await self._add(protocol.encode_event(protocol.CHECKPOINT_SAVED, step=step, path=path))

    async def finished(self, **fields) -> str:
        return await self._add(protocol.training_finished(**fields))

    async def raw(self, fields: dict) -> str:
        return await self._add(fields)
