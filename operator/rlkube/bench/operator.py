"""`rlkube bench operator`: N TrainingJobs created at once against a real kube-apiserver, timed end to end.

The cluster is `--kubeconfig` (default $KUBECONFIG): any API server will do, since no pod really runs (`make bench`
starts the project's own control plane for it). For each N (default 50 and 200): a fresh namespace,
`rlkube operator --namespace NS --standalone` as a subprocess, the fake kubelet of rlkube.bench.simulate running
every pod, and N jobs in external-Redis mode sharing one real redis-server (keys are namespaced per job); the
CRD is applied first. Measured per job:
- create -> all children created: from just before the TrainingJob POST to the last of its pods appearing
  in the kubelet's watch (start-up is readiness-gated, so this includes the kubelet reporting Ready);
- training_finished -> ResourcesReleased: from the XADD of the event (with the trainer's exit 0 right
  after) to ResourcesReleased=True in the job's status, i.e. the whole ordered teardown;
- the operator's peak RSS (the kernel's high-water mark, VmHWM, read just before it is stopped).
Before that, for the same N on the same API server, the baseline (rlkube.bench.jobcontroller): Kubernetes' Job
controller creating N Jobs of as many pods, timed with the same clock (POST -> all pods in a watch).
`--json` prints one JSON list with one object per N: n, create_to_children_p50/p99,
finished_to_released_p50/p99 (seconds), operator_rss_mb, job_controller_create_p50/p99, the ratios ours / the
Job controller's create_ratio_p50/p99 and teardown_ratio_p99 (our teardown p99 / its create p99), and the 1-minute
load average at the end (the machine may be shared), and `api_requests`: what each controller's run cost the
API server per job (requests, writes by kind, mean serving time; rlkube.bench.apimetrics). rlkube.bench.report
says how the latencies are computed.
Needs only the base install (no torch, numpy, aiohttp or psutil), so it runs where the operator does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from subprocess import Popen

import redis.asyncio as aioredis
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube import gctune
from rlkube.api.crd import crd
from rlkube.api.spec import GROUP, PLURAL, VERSION
from rlkube.bench import apimetrics, jobcontroller, processes, report
from rlkube.bench.jobs import JobRecorder
from rlkube.bench.simulate import FakeKubelet, TrainerPlayer
from rlkube.local.ports import free_port
from rlkube.local.redis_server import RedisServer

PODS_PER_JOB = 4  # trainer, inference, preprocessor, actor (external Redis: no Redis pod)
MAX_STEPS = 10
RUNNING = ("Running", "Draining", "Succeeded")  # a job seen in any of these has run


def log(msg: str) -> None:
    print(f"[bench operator {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:  # refused while starting; HTTPError (a 5xx) is an OSError too
        return False


async def wait_live(port: int, proc: Popen, timeout: float = 60) -> None:
    """Until kopf's liveness endpoint answers (the operator has started and authenticated)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(_answers, f"http://127.0.0.1:{port}/healthz"):
        if proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise TimeoutError("the operator did not come up")
        await asyncio.sleep(0.1)  # an HTTP endpoint to poll: there is nothing to watch


async def run_one(
    api: client.ApiClient, kubeconfig: Path, redis_url: str, n: int, workdir: Path
) -> tuple[list[float], list[float], float, dict]:
    """(create -> all children, training_finished -> ResourcesReleased) per job, the operator's peak RSS, and what
    the jobs cost the API server (apimetrics.summary, from the first POST to the last ResourcesReleased)."""
    namespace = f"bench-{n}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    # Undone in reverse order whatever fails: the operator stops first, the namespace goes last.
    async with contextlib.AsyncExitStack() as stack:
        await core.create_namespace({"metadata": {"name": namespace}})

        async def delete_namespace() -> None:
            with contextlib.suppress(ApiException):
                await core.delete_namespace(namespace)

        stack.push_async_callback(delete_namespace)
        kubelet = FakeKubelet(api, namespace, stop_delay=0.05, redis_dir=workdir / "redis")
        stack.push_async_callback(kubelet.close)
        await kubelet.start()
        jobs = JobRecorder(api, namespace)
        stack.push_async_callback(jobs.close)
        await jobs.start()
        redis_client = aioredis.Redis.from_url(redis_url)
        stack.push_async_callback(redis_client.aclose)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "OMP_NUM_THREADS": "1"}
        port = free_port()
        proc = processes.spawn(
            [sys.executable, "-m", "rlkube.cli", "operator", "--namespace", namespace, "--standalone",
             "--metrics-port", "0", "--liveness", f"http://127.0.0.1:{port}/healthz"],
            workdir / f"operator-{n}.log", env,
        )
        stack.callback(processes.stop, proc)
        await wait_live(port, proc)  # time the jobs, not the operator's start-up

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
        measured = {"operator": proc.pid, "bench": os.getpid()}
        before = await apimetrics.scrape(api, measured)
        await asyncio.gather(*(create(name) for name in names))

        def children_done() -> bool:
            return all(len(kubelet.job_pods(name)) >= PODS_PER_JOB for name in names)

        await kubelet.wait_for(children_done, 120 + 2 * n, "all children created")
        create_to_children = [
            max(r.created_at for r in kubelet.job_pods(name)) - created_at[name] for name in names
        ]
        await jobs.wait(lambda: all(jobs.first_seen(name, RUNNING) for name in names), 120 + 2 * n, "all Running")
        log(f"N={n}: all {n} jobs Running; finishing them")

        finished_at: dict[str, float] = {}

        async def finish(name: str) -> None:
            async with gate:
                player = TrainerPlayer(redis_client, namespace, name)
                await player.finished(step=MAX_STEPS, checkpoint=f"/checkpoints/step-{MAX_STEPS}")
                finished_at[name] = time.monotonic()
                await kubelet.exit(f"{name}-trainer-0", 0)

        def released(name: str) -> float | None:
            return jobs.true_at.get(name, {}).get("ResourcesReleased")

        await asyncio.gather(*(finish(name) for name in names))
        await jobs.wait(lambda: all(released(name) for name in names), 120 + 2 * n, "all ResourcesReleased")
        finished_to_released = [released(name) - finished_at[name] for name in names]
        requests = apimetrics.summary(await apimetrics.scrape(api, measured) - before, n)
        peak_mib, operator_cpu = processes.usage(proc.pid)
        me = os.times()
        log(f"N={n}: done; CPU seconds: operator {operator_cpu:.1f}, "
            f"bench (kubelet, trainer, watches) {me.user + me.system:.1f}; load {os.getloadavg()[0]:.1f}")
        return create_to_children, finished_to_released, peak_mib, requests


async def api_client(kubeconfig: str, pool_size: int) -> client.ApiClient:
    """The bench's own client (the operator's is rlkube.controller.reconcile.apiclient): the kubeconfig, `pool_size`
    connections, and no proxy lookup per request (kubernetes_asyncio's session has trust_env on, which reads
    ~/.netrc in a worker thread on every call)."""
    cfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    api = client.ApiClient(configuration=cfg)
    api.rest_client.pool_manager._trust_env = False
    return api


async def run_all(sizes: list[int], kubeconfig: Path, workdir: Path, controller_manager: str | None) -> list[dict]:
    api = await api_client(str(kubeconfig), pool_size=64)
    redis_server = RedisServer(workdir / "shared-redis").start()
    try:
        await apply_crd(api)
        results = []
        for n in sizes:
            # The Job controller first: its namespace is gone (waited for) before the operator starts, whereas
            # ours cannot be (its TrainingJobs keep the operator's finalizer once the operator has stopped).
            baseline, baseline_requests = None, None
            if controller_manager is not None:
                baseline, baseline_requests = await jobcontroller.measure(
                    api, kubeconfig, controller_manager, n, PODS_PER_JOB, workdir)
            create, teardown, rss, requests = await run_one(api, kubeconfig, redis_server.url, n, workdir)
            row = report.summary(n, create, teardown, rss, baseline, load_1m=os.getloadavg()[0])
            row["api_requests"] = {"ours": requests, "job_controller": baseline_requests}
            results.append(row)
            log(json.dumps(results[-1]))
        return results
    finally:
        redis_server.stop()
        await api.close()


def cli(args: argparse.Namespace) -> int:
    kubeconfig = args.kubeconfig or os.environ.get("KUBECONFIG")
    if not kubeconfig:
        raise SystemExit("rlkube bench operator: no cluster: pass --kubeconfig or set KUBECONFIG "
                         "(`make bench` starts a local control plane and passes its kubeconfig)")
    controller_manager = None
    if not args.no_baseline:
        controller_manager = jobcontroller.find_controller_manager(args.kube_controller_manager)
        if controller_manager is None:
            raise SystemExit("rlkube bench operator: no kube-controller-manager for the Job controller baseline: "
                             "pass --kube-controller-manager or set KUBE_CONTROLLER_MANAGER_BIN "
                             "(`make control-plane` builds one), or --no-baseline")
        jobcontroller.check_binary(controller_manager)
    sizes = args.n or [50, 200]
    workdir = Path(tempfile.mkdtemp(prefix="rlkube-bench-operator-"))
    gctune.tune()  # as the operator does: this process plays the node beside it on the same CPUs
    results = asyncio.run(run_all(sizes, Path(kubeconfig), workdir, controller_manager))
    print(json.dumps(results) if args.json else report.table(results))
    print(f"logs: {workdir}", file=sys.stderr)
    return 0
