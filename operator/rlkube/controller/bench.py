"""`rlkube bench operator`: N TrainingJobs created at once against a real kube-apiserver, timed end to end.

For each N (default 50 and 200): a fresh namespace, `rlkube operator --namespace NS --standalone` as a
subprocess, the fake kubelet of rlkube.controller.simulate running every pod, and N jobs in external-Redis
mode sharing one real redis-server (keys are namespaced per job). Measured per job:
- create -> all children created: from just before the TrainingJob POST to the last of its pods appearing
  in the kubelet's watch (start-up is readiness-gated, so this includes the kubelet reporting Ready);
- training_finished -> ResourcesReleased: from the XADD of the event (with the trainer's exit 0 right
  after) to ResourcesReleased=True in the job's status, i.e. the whole ordered teardown;
- the operator's peak RSS (sampled every 0.2 s).
`--json` prints one JSON list with one object per N: n, create_to_children_p50/p99,
finished_to_released_p50/p99 (seconds) and operator_rss_mb.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
import redis.asyncio as aioredis
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.api.crd import crd
from rlkube.api.spec import GROUP, PLURAL, VERSION
from rlkube.controller.simulate import FakeKubelet, TrainerPlayer
from rlkube.local.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[3]
PODS_PER_JOB = 4  # trainer, inference, preprocessor, actor (external Redis: no Redis pod)
MAX_STEPS = 10


def log(msg: str) -> None:
    print(f"[bench operator {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def job_manifest(name: str, redis_url: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "builtin://tiny-llama"},
            "algorithm": {"maxSteps": MAX_STEPS},
            "inference": {"engine": "native"},
            "redis": {"mode": "external", "url": redis_url},
            "runPolicy": {"completionTimeoutSeconds": 120, "eventTimeoutSeconds": 0},
            "teardown": {"gracePeriodSeconds": {"actor": 10, "preprocessor": 10, "inference": 10, "trainer": 10,
                                                "redis": 10}},
        },
    }


async def apply_crd(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    body = crd()
    name = body["metadata"]["name"]
    try:
        await ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
        current = await ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        await ext.replace_custom_resource_definition(name, body)
    deadline = time.monotonic() + 60
    custom = client.CustomObjectsApi(api)
    while True:
        try:
            await custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
            return
        except ApiException:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)  # waiting for the API server to serve the new CRD (no watch for that)


class Released:
    """Watches the namespace's TrainingJobs; records when each first shows Running and ResourcesReleased=True."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self.running: dict[str, float] = {}
        self.released: dict[str, float] = {}
        self.changed = asyncio.Condition()

    async def run(self) -> None:
        rv = None
        while True:
            try:
                if rv is None:
                    listing = await self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)
                    rv = listing["metadata"]["resourceVersion"]
                    for obj in listing["items"]:
                        await self._see(obj)
                stream = watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP, VERSION,
                                              self.namespace, PLURAL, resource_version=rv, timeout_seconds=60)
                async with stream as events:
                    async for event in events:
                        if event["type"] == "ERROR":
                            rv = None
                            break
                        obj = event["raw_object"]
                        rv = obj["metadata"]["resourceVersion"]
                        await self._see(obj)
            except (TimeoutError, ApiException, OSError):
                rv = None
                await asyncio.sleep(0.2)  # retry delay before re-listing

    async def _see(self, obj: dict) -> None:
        name = obj["metadata"]["name"]
        status = obj.get("status") or {}
        now = time.monotonic()
        if status.get("phase") in ("Running", "Draining", "Succeeded") and name not in self.running:
            self.running[name] = now
        conds = status.get("conditions") or []
        if any(c.get("type") == "ResourcesReleased" and c.get("status") == "True" for c in conds):
            self.released.setdefault(name, now)
        async with self.changed:
            self.changed.notify_all()

    async def wait(self, predicate, timeout: float, what: str) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
            except TimeoutError:
                raise TimeoutError(f"{what} not reached within {timeout}s") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_live(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until kopf's liveness endpoint answers (the operator has started and authenticated)."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {proc.returncode} while starting")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"http://127.0.0.1:{port}/healthz") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError("the operator did not come up")
            await asyncio.sleep(0.1)  # an HTTP endpoint to poll: there is nothing to watch


async def sample_rss(pid: int, peak: list[int], stop: asyncio.Event) -> None:
    proc = psutil.Process(pid)
    while not stop.is_set():
        with contextlib.suppress(psutil.Error):
            peak[0] = max(peak[0], proc.memory_info().rss)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)  # the sampling period


async def run_one(api: client.ApiClient, kubeconfig: Path, redis_url: str, n: int, workdir: Path) -> dict:
    namespace = f"bench-{n}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    await core.create_namespace({"metadata": {"name": namespace}})
    kubelet = await FakeKubelet(api, namespace, stop_delay=0.05, redis_dir=workdir / "redis").start()
    released = Released(api, namespace)
    watcher = asyncio.create_task(released.run())
    logf = open(workdir / f"operator-{n}.log", "wb")  # noqa: SIM115, ASYNC230 (handed to the subprocess)
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "OMP_NUM_THREADS": "1"}
    port = free_port()
    proc = subprocess.Popen(  # noqa: ASYNC220 (started once; its lifetime is the whole run)
        [sys.executable, "-m", "rlkube.cli", "operator", "--namespace", namespace, "--standalone",
         "--metrics-port", "0", "--liveness", f"http://127.0.0.1:{port}/healthz"],
        stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    logf.close()
    await wait_live(port, proc)  # time the jobs, not the operator's start-up
    peak = [0]
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(proc.pid, peak, stop))
    redis_client = aioredis.Redis.from_url(redis_url)
    try:
        names = [f"job-{i:04d}" for i in range(n)]
        custom = client.CustomObjectsApi(api)
        created_at: dict[str, float] = {}
        gate = asyncio.Semaphore(32)

        async def create(name: str) -> None:
            async with gate:
                created_at[name] = time.monotonic()
                await custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                             job_manifest(name, redis_url))

        log(f"N={n}: creating {n} TrainingJobs in {namespace}")
        await asyncio.gather(*(create(name) for name in names))

        def children_done() -> bool:
            return all(len(kubelet.job_pods(name)) >= PODS_PER_JOB for name in names)

        await kubelet.wait_for(children_done, 120 + 2 * n, "all children created")
        create_to_children = [
            max(r.created_at for r in kubelet.job_pods(name)) - created_at[name] for name in names
        ]
        await released.wait(lambda: all(name in released.running for name in names), 120 + 2 * n, "all Running")
        log(f"N={n}: all {n} jobs Running; finishing them")

        finished_at: dict[str, float] = {}

        async def finish(name: str) -> None:
            async with gate:
                player = TrainerPlayer(redis_client, namespace, name)
                await player.finished(step=MAX_STEPS, checkpoint=f"/checkpoints/step-{MAX_STEPS}")
                finished_at[name] = time.monotonic()
                await kubelet.exit(f"{name}-trainer-0", 0)

        await asyncio.gather(*(finish(name) for name in names))
        await released.wait(lambda: all(name in released.released for name in names), 120 + 2 * n,
                            "all ResourcesReleased")
        finished_to_released = [released.released[name] - finished_at[name] for name in names]
        cpu = psutil.Process(proc.pid).cpu_times()
        me = psutil.Process().cpu_times()
        log(f"N={n}: done; CPU seconds: operator {cpu.user + cpu.system:.1f}, "
            f"bench (kubelet, trainer, watches) {me.user + me.system:.1f}; load {os.getloadavg()[0]:.1f}")
        return {
            "n": n,
            "create_to_children_p50": round(percentile(create_to_children, 50), 3),
            "create_to_children_p99": round(percentile(create_to_children, 99), 3),
            "finished_to_released_p50": round(percentile(finished_to_released, 50), 3),
            "finished_to_released_p99": round(percentile(finished_to_released, 99), 3),
            "operator_rss_mb": round(peak[0] / 2**20, 1),
        }
    finally:
        stop.set()
        await sampler
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await redis_client.aclose()
        await kubelet.close()
        with contextlib.suppress(ApiException):
            await core.delete_namespace(namespace)


async def run_all(sizes: list[int], kubeconfig: Path, workdir: Path) -> list[dict]:
    api = await config.new_client_from_config(config_file=str(kubeconfig))
    api.configuration.connection_pool_maxsize = 64
    redis_server = RedisServer(workdir / "shared-redis").start()
    try:
        await apply_crd(api)
        results = []
        for n in sizes:
            results.append(await run_one(api, kubeconfig, redis_server.url, n, workdir))
            log(json.dumps(results[-1]))
        return results
    finally:
        redis_server.stop()
        await api.close()


def _control_plane(workdir: Path):
    """A local control plane from the repo's test harness (tests/cluster/control_plane.py)."""
    harness = REPO / "tests" / "cluster" / "control_plane.py"
    if not harness.exists():
        raise SystemExit("no control plane harness here: run from the repository or pass --kubeconfig")
    sys.path.insert(0, str(harness.parent.parent))
    from cluster.control_plane import ControlPlane

    return ControlPlane(workdir / "control-plane").start()


def cli(args: argparse.Namespace) -> int:
    sizes = args.n or [50, 200]
    workdir = Path(tempfile.mkdtemp(prefix="rlkube-bench-operator-"))
    plane = None
    if args.kubeconfig:
        kubeconfig = Path(args.kubeconfig)
    else:
        plane = _control_plane(workdir)
        kubeconfig = plane.kubeconfig
    try:
        results = asyncio.run(run_all(sizes, kubeconfig, workdir))
    finally:
        if plane is not None:
            plane.stop()
    if args.json:
        print(json.dumps(results))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="rlkube operator: N TrainingJobs at once (seconds; RSS in MiB)")
        for col in results[0]:
            table.add_column(col, justify="right")
        for row in results:
            table.add_row(*(str(v) for v in row.values()))
        Console().print(table)
    print(f"logs: {workdir}", file=sys.stderr)
    return 0
