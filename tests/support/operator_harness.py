"""Test harness for the operator integration tests: the operator as a real subprocess, job helpers, a recorder.

- `OperatorProcess`: `rlkube operator --namespace NS --standalone` with KUBECONFIG set; SIGTERM, SIGKILL,
  restart; reads its Prometheus endpoint (reconcile passes per job, to know a pass really happened).
- `job_doc()`: examples/tiny-cpu.yaml with test-sized timeouts and grace periods.
The kubelet and trainer stand-ins (rlkube.bench.simulate) and the recorder of every TrainingJob status
(rlkube.bench.jobs.JobRecorder) are the ones `rlkube bench operator` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.bench.jobs import JobRecorder
from rlkube.bench.simulate import FakeKubelet, TrainerPlayer
from rlkube.local.ports import free_port
from support import specs

GROUP, VERSION, PLURAL = "rlkube.io", "v1alpha1", "trainingjobs"


def job_doc(name: str, **overrides: Any) -> dict:
    """The tiny example with short timers; `overrides` are dotted camelCase paths under spec."""
    doc = specs.document(metadata={"name": name})
    specs.with_overrides(doc["spec"], {
        "runPolicy.completionTimeoutSeconds": 2, "runPolicy.eventTimeoutSeconds": 0,
        "teardown.gracePeriodSeconds": {"actor": 2, "preprocessor": 2, "inference": 2, "trainer": 2, "redis": 2},
        **overrides})
    return doc


class OperatorProcess:
    """One `rlkube operator` process: `--standalone` by default, or with `args` (e.g. leader election flags);
    `name` prefixes its log files and is its POD_NAME (the start of its Lease holder identity)."""

    def __init__(self, kubeconfig: Path, namespace: str, log_dir: Path, args: tuple[str, ...] = ("--standalone",),
                 name: str = "operator"):
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.log_dir = log_dir
        self.args = tuple(args)
        self.name = name
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> OperatorProcess:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}-{self.starts}.log", "wb")
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "OMP_NUM_THREADS": "1", "POD_NAME": self.name}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlkube.cli", "operator", "--namespace", self.namespace, *self.args,
             "--metrics-port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        return self

    def kill(self) -> None:
        """SIGKILL: no cleanup, no chance to finish anything (like a node crash or OOM kill)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}-*.log")))

    async def metrics(self) -> str:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{self.port}/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
                return await r.text()

    async def passes(self, job: str) -> int:
        """Reconcile passes this operator process made for `job` (0 before the first)."""
        try:
            text = await self.metrics()
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0
        needle = f'rlkube_reconcile_passes_total{{namespace="{self.namespace}",trainingjob="{job}"}}'
        for line in text.splitlines():
            if line.startswith(needle):
                return int(float(line.rsplit(" ", 1)[1]))
        return 0

    async def wait_passes(self, job: str, at_least: int, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while True:
            n = await self.passes(job)
            if n >= at_least:
                return n
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"operator made {n} < {at_least} passes for {job} in {timeout}s")
            await asyncio.sleep(0.1)  # polling the metrics endpoint: it has no watch


async def create_job(api: client.ApiClient, namespace: str, doc: dict) -> dict:
    return await client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


async def delete_job(api: client.ApiClient, namespace: str, name: str) -> None:
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


async def patch_spec(api: client.ApiClient, namespace: str, name: str, spec_patch: dict) -> None:
    await client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": spec_patch}, _content_type="application/merge-patch+json"
    )


async def children(api: client.ApiClient, namespace: str, job: str) -> dict[str, dict]:
    """Every child of `job` by `Kind/name` (listed by the job-name label)."""
    core = client.CoreV1Api(api)
    selector = f"rlkube.io/job-name={job}"
    out: dict[str, dict] = {}
    for kind, lister in (
        ("Pod", core.list_namespaced_pod),
        ("Service", core.list_namespaced_service),
        ("Secret", core.list_namespaced_secret),
        ("ConfigMap", core.list_namespaced_config_map),
    ):
        items = (await lister(namespace, label_selector=selector)).items
        for item in items:
            out[f"{kind}/{item.metadata.name}"] = api.sanitize_for_serialization(item)
    return out


class Env:
    """One namespace with its own operator process, fake kubelet and job recorder."""

    def __init__(self, api: client.ApiClient, kubeconfig: Path, namespace: str, log_dir: Path,
                 operator_args: tuple[str, ...] = ("--standalone",), replicas: int = 1, **kubelet: Any):
        self.api = api
        self.namespace = namespace
        names = ["operator"] if replicas == 1 else [f"operator-{chr(ord('a') + i)}" for i in range(replicas)]
        self.operators = [OperatorProcess(kubeconfig, namespace, log_dir, operator_args, n) for n in names]
        self.operator = self.operators[0]
        self.kubelet = FakeKubelet(api, namespace, redis_dir=log_dir / "redis", **kubelet)
        self.recorder = JobRecorder(api, namespace)
        self._redis: list = []

    async def __aenter__(self) -> Env:
        await client.CoreV1Api(self.api).create_namespace(
            {"metadata": {"name": self.namespace, "labels": {"rlkube.io/test": "true"}}}
        )
        await self.kubelet.start()
        await self.recorder.start()
        for operator in self.operators:
            operator.start()
        return self

    async def __aexit__(self, *exc) -> None:
        # Each step runs even if an earlier one fails: no operator or redis-server may outlive the test.
        try:
            for operator in self.operators:
                operator.stop()
            for r in self._redis:
                await r.aclose()
        finally:
            try:
                await self.recorder.close()
            finally:
                try:
                    await self.kubelet.close()
                finally:
                    with contextlib.suppress(ApiException):
                        await client.CoreV1Api(self.api).delete_namespace(self.namespace)

    async def trainer(self, job: str, timeout: float = 30):
        """A TrainerPlayer on the job's managed Redis (the real redis-server the fake kubelet runs)."""
        import redis.asyncio as aioredis

        await self.kubelet.wait_for(lambda: self.kubelet.redis_server(job) is not None, timeout, f"{job} Redis")
        r = aioredis.Redis.from_url(self.kubelet.redis_server(job).url)
        self._redis.append(r)
        return TrainerPlayer(r, self.namespace, job)

    async def wait_pods(self, job: str, names: set[str], timeout: float = 30) -> None:
        """Until exactly these pods of `job` exist (not deleting) and run."""
        def ok() -> bool:
            live = {r.name for r in self.kubelet.live(job) if r.deleting_seq is None}
            return live == names
        await self.kubelet.wait_for(ok, timeout, f"pods {sorted(names)}")


def assert_stage_order(env: Env, job: str) -> None:
    """Every pod of a stage was gone before any pod of the next stage was asked to stop (watch order)."""
    pods = env.kubelet.job_pods(job)
    assert pods and all(p.gone_seq is not None for p in pods), [(p.name, p.gone_seq) for p in pods]
    by_role = {role: [p for p in pods if p.role == role] for role in specs.POD_ORDER}
    for earlier, later in itertools.pairwise(specs.POD_ORDER):
        assert max(p.gone_seq for p in by_role[earlier]) < min(p.deleting_seq for p in by_role[later]), (
            earlier, later)


async def job_events(api: client.ApiClient, namespace: str, job: str) -> list[tuple[str, str, str]]:
    """(type, reason, message) of the Kubernetes Events on a TrainingJob."""
    items = (
        await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={job}")
    ).items
    return [(e.type, e.reason, e.message or "") for e in items if e.involved_object.kind == "TrainingJob"]


async def wait_event(api: client.ApiClient, namespace: str, job: str, reason: str, timeout: float = 20,
                     at_least: int = 1):
    """Until `at_least` Events with `reason` are posted on the job (Events have no cheap watch here: poll the
    list). An Event is posted after the action it reports, so seeing the action does not mean seeing it."""
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in await job_events(api, namespace, job) if e[1] == reason]
        if len(found) >= at_least:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {reason} Event on {job} in {timeout}s: {await job_events(api, namespace, job)}")
        await asyncio.sleep(0.2)


# -- fixtures (imported by the operator test modules) -----------------------------------------------------

import uuid

import pytest
from kubernetes_asyncio import config as _config


@pytest.fixture(scope="session")
async def kapi(cluster, crd):
    """An async API client (kubernetes_asyncio) for the session's cluster, with the CRD applied."""
    api = await _config.new_client_from_config(config_file=str(cluster))
    yield api
    await api.close()


@pytest.fixture
async def env(kapi, cluster, tmp_path):
    """A fresh namespace with its own operator subprocess, fake kubelet and recorder."""
    async with Env(kapi, cluster, f"op-{uuid.uuid4().hex[:8]}", tmp_path) as e:
        yield e
