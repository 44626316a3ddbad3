"""A job's files read through the API server (`rlkube samples JOB`, `rlkube report JOB`): no port-forward, no
network path to the pods.

The samples live in the trainer's checkpoint volume (docs/design.md §5.7). While the trainer pod runs (or a finished
one was kept running, which it is not: a finished trainer exits), the file is read with the pods/exec subresource
(a websocket to the API server, which relays it to the kubelet), as `kubectl exec` does; the trainer's image has
Python, so the read is `python -c` (no shell or coreutils assumed). When the trainer pod is gone or no longer running
and the checkpoint volume is a claim (`spec.trainer.checkpoint.claimName`), a short-lived reader pod mounts the claim
read-only, prints the file, and is deleted; its output comes back through pods/log. An emptyDir volume goes with its
pod: then there is nothing left to read, and the error says so.

kubernetes_asyncio is the base install's client (the operator image carries it for `rlkube bench operator`); its
WsApiClient speaks the exec websocket protocol.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from rlkube.api.role import Role
from rlkube.api.spec import GROUP, PLURAL, VERSION, TrainingJobSpec
from rlkube.lifecycle.phases import PodPhase

READ = "import sys; sys.stdout.write(open(sys.argv[1], encoding='utf-8', errors='replace').read())"
READER_TIMEOUT_S = 120.0
EXEC_REFUSED_S = 30.0
"""How long an exec the API server refuses is retried while the trainer still shows as running: a trainer that ends
between the pod read and the exec (its job finishing) is refused first, and its status follows within seconds."""


class JobFilesError(RuntimeError):
    """The job's file cannot be read (no such job, no trainer pod and no claim, the file absent)."""


@dataclass(frozen=True)
class JobFile:
    text: str
    where: str  # how it was read, for --verbose
    uid: str | None  # the TrainingJob's metadata.uid: the run whose rows are the job's (docs/design.md §5.7)


STDOUT, STDERR, ERROR = 1, 2, 3  # the channels of the exec websocket protocol (v4.channel.k8s.io)


@dataclass(frozen=True)
class ExecResult:
    stdout: str
    stderr: str
    code: int | None  # the command's exit code; None: the API server sent no status (the stream broke)


def exec_result(frames: list[bytes | str]) -> ExecResult:
    """What a pods/exec websocket carried: each frame is its channel's byte then data. Each channel's bytes are
    joined before decoding (a frame may end inside a UTF-8 character); the error channel holds the exit status."""
    channels: dict[int, bytearray] = {STDOUT: bytearray(), STDERR: bytearray(), ERROR: bytearray()}
    for frame in frames:
        data = frame.encode() if isinstance(frame, str) else bytes(frame or b"")
        if len(data) > 1 and data[0] in channels:
            channels[data[0]] += data[1:]
    code: int | None = None
    if channels[ERROR]:
        try:
            status = json.loads(bytes(channels[ERROR]))
            if status.get("status") == "Success":
                code = 0
            else:
                causes = (status.get("details") or {}).get("causes") or []
                code = next((int(c["message"]) for c in causes if c.get("reason") == "ExitCode"), 1)
        except (ValueError, TypeError, AttributeError, KeyError):
            code = 1
    text = {k: bytes(v).decode("utf-8", errors="replace") for k, v in channels.items()}
    if code is None and not text[STDOUT]:
        code = 1  # nothing came back, not even a status: no reading to trust
    return ExecResult(text[STDOUT], text[STDERR] or text[ERROR], code)


def _names(job: str) -> tuple[str, str]:
    from rlkube.controller.manifests import names

    return names.pod_name(job, Role.TRAINER, 0), f"{job}-samples-reader"


async def _read(namespace: str, job: str, filename: str, kubeconfig: str | None,
                context: str | None) -> JobFile:
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.client.rest import ApiException

    cfg = client.Configuration()
    try:
        await config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    except config.ConfigException:
        config.load_incluster_config(client_configuration=cfg)
    async with client.ApiClient(cfg) as api:
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        try:
            obj = await custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, job)
        except ApiException as exc:
            if exc.status == 404:
                raise JobFilesError(f"no TrainingJob {namespace}/{job}") from None
            raise
        uid = (obj.get("metadata") or {}).get("uid")
        spec = (obj.get("status") or {}).get("startedSpec") or obj.get("spec") or {}
        checkpoint = (spec.get("trainer") or {}).get("checkpoint") or {}
        directory = checkpoint.get("path") or "/checkpoints"
        path = f"{directory.rstrip('/')}/{filename}"
        trainer, reader = _names(job)
        pod = None
        try:
            pod = await core.read_namespaced_pod(trainer, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
        result = None
        if pod is not None and pod.status.phase == PodPhase.RUNNING and _running(pod, Role.TRAINER):
            result = await _exec_read(cfg, core, namespace, trainer, path)
        if result is not None:
            if result.code != 0:
                if "FileNotFoundError" in result.stderr:
                    raise JobFilesError(f"{path} does not exist in pod {namespace}/{trainer} yet (spec.samples: the "
                                        "first table is written at step everySteps)")
                raise JobFilesError(f"reading {path} in pod {namespace}/{trainer} failed (exit {result.code}): "
                                    f"{result.stderr[-500:]}")
            return JobFile(result.stdout, f"{path} in the running trainer pod {namespace}/{trainer} (pods/exec)",
                           uid)
        claim = checkpoint.get("claimName")
        if not claim:
            raise JobFilesError(
                f"the trainer pod {namespace}/{trainer} is not running and spec.trainer.checkpoint has no claimName: "
                "its emptyDir volume, and the samples in it, went with the pod")
        image = ((spec.get("trainer") or {}).get("image") or spec.get("image")
                 or TrainingJobSpec.model_fields["image"].default)
        text = await _read_claim(core, namespace, reader, image, claim, directory, path, obj)
        return JobFile(text, f"{path} on claim {namespace}/{claim} (a reader pod, pods/log; the trainer pod is not "
                       "running)", uid)


async def _exec_read(cfg: Any, core: Any, namespace: str, trainer: str, path: str) -> ExecResult | None:
    """`path` read in the running trainer container (pods/exec), or None when the trainer ended before the exec
    reached it: the API server then refuses the exec's upgrade (HTTP 500), and the file is read from the claim."""
    from aiohttp import WSMsgType, WSServerHandshakeError
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.rest import ApiException
    from kubernetes_asyncio.stream import WsApiClient

    loop = asyncio.get_running_loop()
    deadline = loop.time() + EXEC_REFUSED_S
    while True:
        try:
            async with WsApiClient(cfg) as ws:
                # Unparsed (_preload_content=False): the client would json.loads a whole reply and hand back the
                # str() of a one-row file's dict; and its own reader mixes stderr into stdout, dropping the exit code.
                connection = await client.CoreV1Api(ws).connect_get_namespaced_pod_exec(
                    trainer, namespace, container=Role.TRAINER, command=["python", "-c", READ, path], stderr=True,
                    stdin=False, stdout=True, tty=False, _preload_content=False)
                async with connection as socket:
                    return exec_result([m.data async for m in socket
                                        if m.type in (WSMsgType.BINARY, WSMsgType.TEXT)])
        except WSServerHandshakeError as exc:
            refused = f"HTTP {exc.status} {exc.message}"
        try:
            pod = await core.read_namespaced_pod(trainer, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        if not (pod.status.phase == PodPhase.RUNNING and _running(pod, Role.TRAINER)):
            return None
        if loop.time() > deadline:
            raise JobFilesError(f"reading {path} in pod {namespace}/{trainer}: the API server refused the exec "
                                f"({refused}) for {EXEC_REFUSED_S:g}s while the trainer runs")
        await asyncio.sleep(1.0)


def _running(pod: Any, container: str) -> bool:
    for status in pod.status.container_statuses or ():
        if status.name == container:
            return bool(status.state and status.state.running)
    return False


def reader_pod(name: str, image: str, claim: str, directory: str, path: str, owner: dict[str, Any]) -> dict:
    """The pod that prints `path` from the job's checkpoint claim (read-only), hardened like the job's pods and
    owned by the job (deleted with it if the reader is interrupted)."""
    meta = owner.get("metadata") or {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "rlkube", "rlkube.io/job-name": meta.get("name"),
                                              "rlkube.io/role": "samples-reader"},
                     "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                                          "name": meta.get("name"), "uid": meta.get("uid")}]},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "reader", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["python", "-c", READ, path],
                "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "checkpoints", "mountPath": directory, "readOnly": True},
                                 {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
                        {"name": "tmp", "emptyDir": {"sizeLimit": "16Mi"}}],
        },
    }


async def _read_claim(core: Any, namespace: str, name: str, image: str, claim: str, directory: str, path: str,
                      owner: dict) -> str:
    from kubernetes_asyncio.client.rest import ApiException

    try:
        await core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    except ApiException as exc:
        if exc.status != 404:
            raise
    await _gone(core, namespace, name)
    await core.create_namespaced_pod(namespace, reader_pod(name, image, claim, directory, path, owner))
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READER_TIMEOUT_S
        while True:
            pod = await core.read_namespaced_pod(name, namespace)
            if pod.status.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED):
                break
            if loop.time() > deadline:
                raise JobFilesError(f"the reader pod {namespace}/{name} did not finish in {READER_TIMEOUT_S:g}s "
                                    f"(phase {pod.status.phase})")
            await asyncio.sleep(0.5)
        # Unparsed, as the exec above: a one-row file is one JSON object, which the client would turn into a dict.
        response = await core.read_namespaced_pod_log(name, namespace, container="reader", _preload_content=False)
        try:
            log = (await response.read()).decode("utf-8", errors="replace")
        finally:
            response.release()
        if pod.status.phase == PodPhase.FAILED:
            raise JobFilesError(f"reading {path} from claim {claim} failed: {log[-500:]}")
        return log
    finally:
        try:
            await core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException:
            pass


async def _gone(core: Any, namespace: str, name: str, timeout_s: float = 60.0) -> None:
    """Until the pod `name` no longer exists (a reader left by an interrupted read), bounded."""
    from kubernetes_asyncio.client.rest import ApiException

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            await core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        if loop.time() > deadline:
            raise JobFilesError(f"the previous reader pod {namespace}/{name} is still there after {timeout_s:g}s")
        await asyncio.sleep(0.5)


def read_job_file(namespace: str, job: str, filename: str, kubeconfig: str | None = None,
                  context: str | None = None) -> JobFile:
    """`filename` in job `job`'s trainer output (its checkpoint directory): its text, where it was read, and the
    job's uid (its run: the claim may also hold an earlier job's rows)."""
    return asyncio.run(_read(namespace, job, filename, kubeconfig, context))
