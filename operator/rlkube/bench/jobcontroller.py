"""The baseline of `rlkube bench operator`: Kubernetes' own Job controller creating as many pods on the same API
server, timed with the same watch-based clock.

A kube-controller-manager runs with only the `job` controller (leader election off, 100 QPS to the API server:
what a production control plane gives its controllers, where the default is 20), N Jobs with
parallelism = completions = k (the pods of one TrainingJob) are POSTed at once with the same concurrency as the
TrainingJobs, and each Job is timed from just before its POST to the last of its k pods appearing in a pod
watch. Nothing runs the pods (no kubelet): the Job controller does not wait for them, so this is its creation
path alone, which is what users already run and what our operator is compared with.

The controller manager is found at --kube-controller-manager, $KUBE_CONTROLLER_MANAGER_BIN, on PATH, or where
`make control-plane` builds it (~/.cache/rlkube/k8s-1.20.2/bin, or under $RLKUBE_CACHE).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.bench import apimetrics, processes
from rlkube.bench.listwatch import ListWatch

QPS = 100
BURST = 100
LABEL = "rlkube.io/bench"
VALUE = "job-controller-baseline"
IMAGE = "registry.k8s.io/pause:3.2"  # never pulled: no kubelet runs these pods


def log(msg: str) -> None:
    print(f"[bench job-controller {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def find_controller_manager(explicit: str | None = None) -> str | None:
    cache = Path(os.environ.get("RLKUBE_CACHE", Path.home() / ".cache" / "rlkube"))
    for candidate in (
        explicit,
        os.environ.get("KUBE_CONTROLLER_MANAGER_BIN"),
        shutil.which("kube-controller-manager"),
        str(cache / "k8s-1.20.2" / "bin" / "kube-controller-manager"),
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def controller_manager_argv(binary: str, kubeconfig: Path, qps: float = QPS, burst: int = BURST) -> list[str]:
    return [
        binary,
        f"--kubeconfig={kubeconfig}",
        "--controllers=job",
        "--leader-elect=false",
        f"--kube-api-qps={qps}",
        f"--kube-api-burst={burst}",
        # No serving at all (nothing reads its health or metrics: readiness is a warm-up Job's pod appearing).
        "--secure-port=0",
        "--port=0",
    ]


def job_manifest(name: str, pods: int) -> dict:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": {LABEL: VALUE}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "main", "image": IMAGE}]},
            },
        },
    }


class PodClock:
    """When each Job's pods first appeared in the pod watch (the Job controller labels them job-name=<job>)."""

    def __init__(self, api: client.ApiClient, namespace: str):
        self.seen: dict[str, dict[str, float]] = {}  # job -> pod name -> monotonic time first seen
        self._changed = asyncio.Condition()
        self._watch = ListWatch.pods(api, namespace, self._record, f"{LABEL}={VALUE}")

    async def _record(self, type_: str, pod: dict) -> None:
        job = (pod["metadata"].get("labels") or {}).get("job-name")
        if job and type_ != "DELETED":
            self.seen.setdefault(job, {}).setdefault(pod["metadata"]["name"], time.monotonic())
            async with self._changed:
                self._changed.notify_all()

    async def start(self) -> None:
        await self._watch.start()

    async def close(self) -> None:
        await self._watch.close()

    def count(self, job: str) -> int:
        return len(self.seen.get(job, ()))

    def last(self, job: str) -> float:
        return max(self.seen[job].values())

    async def wait(self, predicate, timeout: float, what: str) -> None:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                raise TimeoutError(f"Job controller baseline: {what} not reached in {timeout}s") from None


async def wait_namespace_gone(api: client.ApiClient, namespace: str, timeout: float) -> bool:
    """Until the namespace is deleted (watched, not polled); False when it is still there after `timeout`."""
    core = client.CoreV1Api(api)
    gone = asyncio.Event()

    async def on_event(type_: str, obj: dict) -> None:
        if type_ == "DELETED":
            gone.set()

    watch = ListWatch(api, core.list_namespace, (), on_event, field_selector=f"metadata.name={namespace}")
    await watch.start()
    try:
        try:
            await core.read_namespace(namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True  # already gone before the watch started
            raise
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(gone.wait(), timeout)
        return gone.is_set()
    finally:
        await watch.close()


async def measure(
    api: client.ApiClient,
    kubeconfig: Path,
    binary: str,
    n: int,
    pods: int,
    workdir: Path,
    concurrency: int = 32,
) -> tuple[list[float], dict]:
    """POST -> all `pods` pods exist, in seconds, for each of `n` Jobs created at once (in a fresh namespace,
    deleted afterwards and waited for, so the next measurement does not share the API server with it), and what
    those n Jobs cost the API server (apimetrics.summary, from the POSTs to the last pod)."""
    namespace = f"bench-jobctl-{n}-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(api)
    batch = client.BatchV1Api(api)
    log_path = workdir / f"kube-controller-manager-{n}.log"
    async with contextlib.AsyncExitStack() as stack:
        await core.create_namespace({"metadata": {"name": namespace}})

        async def delete_namespace() -> None:
            with contextlib.suppress(ApiException):
                await core.delete_namespace(namespace)
            if not await wait_namespace_gone(api, namespace, 120 + n):
                log(f"namespace {namespace} still terminating; going on")

        stack.push_async_callback(delete_namespace)
        clock = PodClock(api, namespace)
        await clock.start()
        stack.push_async_callback(clock.close)
        proc = processes.spawn(controller_manager_argv(binary, kubeconfig), log_path)
        stack.callback(processes.stop, proc)

        async def create(name: str, gate: asyncio.Semaphore | None = None) -> float:
            async with gate or contextlib.nullcontext():
                t0 = time.monotonic()
                response = await batch.create_namespaced_job(namespace, job_manifest(name, pods),
                                                             _preload_content=False)
                response.release()
                return t0

        # Ready when it has created a warm-up Job's pod: its informers have synced and it is writing.
        await create("warm-up")
        ready = asyncio.ensure_future(clock.wait(lambda: clock.count("warm-up") >= pods, 120, "warm-up Job"))
        exited = asyncio.ensure_future(asyncio.to_thread(proc.wait))
        await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            raise RuntimeError(f"kube-controller-manager exited with {proc.returncode}:\n{processes.log_tail(log_path)}")
        exited.cancel()  # the thread waiting on the process ends when processes.stop() reaps it
        ready.result()

        names = [f"job-{i:04d}" for i in range(n)]
        gate = asyncio.Semaphore(concurrency)
        log(f"N={n}: creating {n} Jobs of {pods} pods in {namespace} (kube-controller-manager, {QPS} QPS)")
        before = await apimetrics.scrape(api, {"bench": os.getpid()})
        posted = dict(zip(names, await asyncio.gather(*(create(name, gate) for name in names)), strict=True))
        await clock.wait(lambda: all(clock.count(name) >= pods for name in names), 120 + 2 * n, "all pods")
        requests = apimetrics.summary(await apimetrics.scrape(api, {"bench": os.getpid()}) - before, n)
        return [clock.last(name) - posted[name] for name in names], requests


def check_binary(binary: str) -> None:
    """Fail early (before the operator's run) when the binary cannot even print its version."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"{binary} --version failed: {out.stderr.strip()}")
