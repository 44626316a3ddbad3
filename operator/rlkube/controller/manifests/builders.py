"""TrainingJob -> the manifests of its children, as plain dicts. Pure: no client, no clock, no randomness.

What is built (docs/design.md §3): a ConfigMap with the job config, the managed Redis (a Secret whose password is
minted by the applier when it creates it, actions.Create.mint, so building one is pure; Pod, headless Service, and
a NetworkPolicy that admits only the job's pods and the operator),
headless Services for inference and trainer, and one Pod per replica of trainer, inference, preprocessor and
actor. Pods rather than Deployments or Jobs: the operator deletes them stage by stage and reads each one's exit
code. Each pod is then merged with the role's `spec.<role>.template` (controller/manifests/podtemplate.py).

Hardened by default (Pod Security Standards "restricted"): every pod runs as the images' non-root user 10001
with seccomp RuntimeDefault, no privilege escalation and every capability dropped, and a read-only root
filesystem where the role allows it; what a role writes goes to volumes: /tmp (an emptyDir, also HOME), the
checkpoints, and a memory-backed /dev/shm for the trainer and inference. vLLM inference pods with GPUs and
Fast-LLM trainer pods keep a writable root: they run third-party code whose JIT and kernel caches write where we do
not control (vLLM on CPU writes only under HOME: writable_root).
The model is ready before a role starts: every pod that loads it (lifecycle.roles.MODEL_ROLES) has an init
container that materializes spec.model.path into the model cache volume (emptyDir, or spec.model.cacheClaimName
shared by the job's pods) with rlkube.core.hf.fetch; the role then runs with HF_HUB_OFFLINE=1. spec.model.claimName
and spec.task.dataset.claimName are mounted read-only where they are read.
GPU pods get `nvidia.com/gpu` limits (TrainingJobSpec.gpus_per_pod, a property of the spec type); a trainer with several
ranks per pod runs the launcher (lifecycle.environment.role_module), and trainer pods spread one per node
(podAntiAffinity: required with GPUs, preferred on CPU so that a one-node CPU cluster still runs a multi-node job).

Every Service is headless and maps port == targetPort: the test cluster has no kube-proxy and the node agent
resolves `{pod}.{service}` to pod IPs directly, exactly as cluster DNS does for headless Services.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlkube.api.role import Backend, Role
from rlkube.api.spec import GPU, TrainingJobSpec
from rlkube.contract import runtime
from rlkube.controller.manifests import fastllm, names, podtemplate
from rlkube.controller.manifests.model_data import data_volumes, with_model_init
from rlkube.controller.manifests.placement import Placement, with_placement
from rlkube.lifecycle import image_reference
from rlkube.lifecycle.environment import POD_IP, Addresses, role_env, role_module, sandbox_env
from rlkube.lifecycle.roles import MODEL_ROLES, START_ORDER, colocated, replicas, uses_sandbox_pods

MASTER_PORT = 29400
"""torch.distributed rendezvous of a multi-node trainer (distinct from the weight-sync store on 29500)."""
RUN_AS = 10001
"""The images' user (images/*/Dockerfile `USER 10001`); the managed Redis runs as it too (it writes nothing)."""
SANDBOX_RUN_AS = 10002
"""The sandbox pods' user: one no other role of the job runs as, so a snippet owns nothing of theirs (a volume a
template shares, a process count under RLIMIT_NPROC)."""


@dataclass(frozen=True)
class JobRef:
    """The parts of a TrainingJob the builders need."""

    namespace: str
    name: str
    uid: str
    spec: TrainingJobSpec
    raw_spec: dict[str, Any]
    """The spec as applied (camelCase, with the API server's defaults): what the pods read."""

    @property
    def managed_redis(self) -> bool:
        return self.spec.redis.mode == "managed"


def pod_names(job: JobRef, role: str) -> list[str]:
    return [names.pod_name(job.name, role, i) for i in range(replicas(job.spec, role))]


def _meta(job: JobRef, name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": labels,
        "ownerReferences": [names.owner_reference(job.name, job.uid)],
    }
    if annotations:
        meta["annotations"] = annotations
    return meta


def redis_url(job: JobRef) -> str:
    """What the roles connect to (without the password, which comes from a Secret)."""
    if job.managed_redis:
        return f"redis://{names.service_name(job.name, Role.REDIS)}:{runtime.REDIS_PORT}/0"
    assert job.spec.redis.url  # validation guarantees it in external mode
    return job.spec.redis.url


def _password_env(job: JobRef) -> list[dict]:
    if job.managed_redis:
        ref = {"name": names.secret_name(job.name), "key": names.SECRET_KEY}
    elif job.spec.redis.password_secret is not None:
        ref = {"name": job.spec.redis.password_secret.name, "key": job.spec.redis.password_secret.key}
    else:
        return []
    return [{"name": runtime.ENV_REDIS_PASSWORD, "valueFrom": {"secretKeyRef": ref}}]


def _pod_ip_env() -> dict:
    return {"name": POD_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def _resources(spec: TrainingJobSpec, role: str) -> dict:
    res = spec.section(role).resources
    out: dict[str, dict] = {}
    if res.requests:
        out["requests"] = dict(res.requests)
    if res.limits:
        out["limits"] = dict(res.limits)
    gpus = spec.gpus_per_pod(role)
    if gpus:
        # The count follows gpusPerNode / tensorParallel, replacing one written in resources. Extended resources
        # must be in limits; requests default to them, and must equal them when given.
        out.setdefault("limits", {})[GPU] = gpus
        if GPU in out.get("requests", {}):
            out["requests"][GPU] = gpus
    return out


def writable_root(spec: TrainingJobSpec, role: str) -> bool:
    """Roles whose root filesystem stays writable: third-party servers with caches we do not control. vLLM on CPU
    is not one: its caches follow HOME onto /tmp (VLLM_CACHE_ROOT, torch's inductor directory), shown on a real
    kubelet by tests/e2e/real_node/test_vllm_image.py; vLLM on GPUs (JIT and kernel caches) has not been run on one
    here."""
    return (role == Role.INFERENCE and spec.inference.engine == "vllm" and spec.gpus_per_pod(Role.INFERENCE) > 0) or (
        role == Role.TRAINER and spec.trainer.backend == Backend.FAST_LLM
    )


def pod_security_context() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,  # volumes (emptyDir, PVC checkpoints) writable by the pod's group
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context(read_only_root: bool) -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }


def config_map(job: JobRef) -> dict:
    """`{job}-config` with `job.json` in runtime.job_config's format, the run's uid the job's (and a fast-llm job's
    Fast-LLM config)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, names.config_name(job.name), names.job_labels(job.name)),
        "data": {
            names.CONFIG_KEY: runtime.job_config(job.namespace, job.name, job.raw_spec, job.uid),
            **fastllm.config_map_data(job.spec, job.namespace, job.name),
        },
    }


def redis_secret(job: JobRef, password: str | None = None) -> dict:
    """The managed Redis' password Secret. The decisions build it without a password: the applier mints one as it
    creates the Secret (actions.Create.mint); `password` is for renderings that want a complete manifest."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(job, names.secret_name(job.name), names.role_labels(job.name, Role.REDIS)),
        "type": "Opaque",
    }
    if password is not None:
        secret["stringData"] = {names.SECRET_KEY: password}
    return secret


ROLE_PORTS: dict[str, tuple[tuple[str, int], ...]] = {
    Role.REDIS: (("redis", runtime.REDIS_PORT),),
    Role.INFERENCE: (("http", runtime.INFERENCE_PORT),),
    Role.TRAINER: (("weight-sync", runtime.WEIGHT_SYNC_PORT), ("rendezvous", MASTER_PORT)),
    Role.SANDBOX: (("http", runtime.SANDBOX_PORT),),
}
"""The named ports a role's pods listen on: their containers' ports and their Service's, written once."""


def role_ports(spec: TrainingJobSpec, role: str) -> list[tuple[str, int]]:
    ports = list(ROLE_PORTS[role])
    if role == Role.TRAINER and colocated(spec):  # its pod serves the engine too (rlkube.core.launch.colocated)
        ports += ROLE_PORTS[Role.INFERENCE]
    return ports


def _container_ports(spec: TrainingJobSpec, role: str) -> list[dict]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"} for name, port in role_ports(spec, role)]


def service(job: JobRef, role: str) -> dict:
    ports = role_ports(job.spec, role)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, names.service_name(job.name, role), names.role_labels(job.name, role)),
        "spec": {
            "clusterIP": "None",
            "selector": names.role_selector(job.name, role),
            # Pods must resolve each other before they are Ready: inference only turns Ready after joining the
            # trainer's weight-update group, and trainer ranks rendezvous before anything is Ready.
            "publishNotReadyAddresses": True,
            "ports": [
                {"name": port_name, "port": port, "targetPort": port, "protocol": "TCP"}
                for port_name, port in ports
            ],
        },
    }


def services(job: JobRef) -> list[dict]:
    return [service(job, r) for r in service_roles(job.spec)]


def service_roles(spec: TrainingJobSpec) -> list[str]:
    """Roles of this job that have a headless Service: Redis when managed, the sandbox with sandbox pods, inference
    unless its engine is colocated in the trainer's pod (reached through the trainer's Service)."""
    return [r for r in names.SERVICE_ROLES
            if (r != Role.REDIS or spec.redis.mode == "managed") and (r != Role.SANDBOX or uses_sandbox_pods(spec))
            and (r != Role.INFERENCE or not colocated(spec))]


OPERATOR_PEER = {"app.kubernetes.io/part-of": "rlkube", "app.kubernetes.io/component": "operator"}
"""Labels of the operator's own pods (charts/rlkube selectorLabels): it reads the trainer's events from Redis."""


def redis_network_policy(job: JobRef) -> dict:
    """Only the job's own pods (same namespace, the job's labels) and the rlkube operator reach the managed Redis.

    The operator's namespace is not known to these pure builders, so its peer matches the chart's operator labels
    in any namespace; Redis still asks every client for the job's password."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, names.network_policy_name(job.name), names.role_labels(job.name, Role.REDIS)),
        "spec": {
            "podSelector": {"matchLabels": names.role_selector(job.name, Role.REDIS)},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [
                    {"podSelector": {"matchLabels": names.job_labels(job.name)}},
                    {"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_PEER)}},
                ],
                "ports": [{"protocol": "TCP", "port": runtime.REDIS_PORT}],
            }],
        },
    }


def sandbox_network_policy(job: JobRef) -> dict:
    """The sandbox pods take connections from the job's actors only, on the server's port, and open none (no egress
    rule: not even DNS). Where the CNI enforces NetworkPolicy this is a second wall around the snippets; the first
    holds without it (each snippet's own network namespace, rlkube.core.sandbox.server)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, names.sandbox_network_policy_name(job.name), names.role_labels(job.name, Role.SANDBOX)),
        "spec": {
            "podSelector": {"matchLabels": names.role_selector(job.name, Role.SANDBOX)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{
                "from": [{"podSelector": {"matchLabels": names.role_selector(job.name, Role.ACTOR)}}],
                "ports": [{"protocol": "TCP", "port": runtime.SANDBOX_PORT}],
            }],
            "egress": [],
        },
    }


def static_children(job: JobRef, password: str | None = None) -> list[dict]:
    """Everything that is not a pod: created first, deleted after the last teardown stage."""
    out = [config_map(job)]
    if job.managed_redis:
        out += [redis_secret(job, password), redis_network_policy(job)]
    if uses_sandbox_pods(job.spec):
        out.append(sandbox_network_policy(job))
    return out + services(job)


def _trainer_spread(job: JobRef) -> dict:
    """One trainer pod per node: its GPUs are the node's; on CPU a preference, so one node can still run it."""
    term = {"labelSelector": {"matchLabels": names.role_selector(job.name, Role.TRAINER)},
            "topologyKey": "kubernetes.io/hostname"}
    if job.spec.trainer.gpus_per_node:
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 100, "podAffinityTerm": term}]}}


def _pod(job: JobRef, role: str, index: int, container: dict, volumes: list[dict], annotations: dict) -> dict:
    policies = job.spec.run_policy.restart_policy
    container["securityContext"] = container_security_context(not writable_root(job.spec, role))
    spec: dict[str, Any] = {
        # Redis is a plain server: restart it whatever the exit. Core roles follow runPolicy.restartPolicy.
        "restartPolicy": policies.of(role),
        "terminationGracePeriodSeconds": job.spec.teardown.grace_period_seconds.of(role),
        # Service links would inject env such as `{JOB}_REDIS_PORT` that can shadow the runtime contract.
        "enableServiceLinks": False,
        # No role talks to the API server: no ServiceAccount token in any role pod unless its template asks for
        # one (docs/design.md §3).
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "containers": [container],
    }
    if volumes:
        spec["volumes"] = volumes
    if role in names.SERVICE_ROLES:
        spec["hostname"] = names.pod_name(job.name, role, index)
        spec["subdomain"] = names.service_name(job.name, role)
    if role == Role.TRAINER and job.spec.trainer.nodes > 1:
        spec["affinity"] = _trainer_spread(job)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _meta(
            job, names.pod_name(job.name, role, index), names.pod_labels(job.name, role, index), annotations
        ),
        "spec": spec,
    }
    return podtemplate.apply(pod, job.spec.template_for(role))


def redis_pod(job: JobRef, attempt: int = 0) -> dict:
    port = runtime.REDIS_PORT
    container = {
        "name": "redis",
        "image": role_image(job.spec, Role.REDIS),
        "command": [
            "redis-server", "--port", str(port), "--bind", "$(POD_IP)", "--requirepass", "$(REDIS_PASSWORD)",
            "--save", "", "--appendonly", "no",
        ],
        "env": [_pod_ip_env(), *_password_env(job)],
        "ports": _container_ports(job.spec, Role.REDIS),
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 2, "failureThreshold": 3},
    }
    return _pod(job, Role.REDIS, 0, container, [], {names.ANNOTATION_ATTEMPT: str(attempt)})


def addresses(job: JobRef) -> Addresses:
    """Where the job's parts are in a cluster: headless-Service names, and the pod's own IP to bind to."""
    spec = job.spec
    trainer0 = names.trainer_host(job.name, 0)
    return Addresses(
        config_path=f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}",
        redis_url=redis_url(job),
        # $(POD_IP) expands only from variables defined earlier in the container's env list (see _core_env).
        bind_host="$(POD_IP)",
        # A colocated engine serves from the trainer's pod (rlkube.core.launch.colocated).
        inference_urls=((f"http://{trainer0}:{runtime.INFERENCE_PORT}",) if colocated(spec) else
                        tuple(names.inference_urls(job.name, spec.inference.replicas, runtime.INFERENCE_PORT))),
        inference_ports=(runtime.INFERENCE_PORT,) * spec.inference.replicas,
        weight_sync_host=trainer0,
        weight_sync_port=runtime.WEIGHT_SYNC_PORT,
        master_port=MASTER_PORT,
        checkpoint_dir=spec.trainer.checkpoint.path,
        model_cache_dir=names.MODEL_CACHE_MOUNT,
        sandbox_urls=tuple(names.sandbox_urls(job.name, replicas(spec, Role.SANDBOX), runtime.SANDBOX_PORT)),
    )


def sandbox_pod(job: JobRef, index: int, attempt: int = 0) -> dict:
    """Sandbox pod `index` (spec.sandbox.mode `pods`): `python -m rlkube.core.sandbox`, the HTTP server that runs the
    actors' snippets (docs/guide/sandbox.md). What it holds of the job is its limits and nothing else: no Redis
    address or password, no job config, no ServiceAccount token. Its own uid, every capability dropped, a read-only
    root, seccomp RuntimeDefault, spec.sandbox.runtimeClassName (gVisor by default), cpu/memory/ephemeral-storage
    limits, and /tmp an emptyDir (no larger than the ephemeral-storage limit) where each snippet gets a fresh
    directory. restartPolicy Always: a server that dies restarts in place; a pod that is gone is recreated by the
    next pass, as any role's."""
    spec = job.spec
    pool = spec.sandbox
    container: dict[str, Any] = {
        "name": "sandbox",
        "image": role_image(spec, Role.SANDBOX),
        "command": ["python", "-m", "rlkube.core.sandbox"],
        "env": [_pod_ip_env(), *({"name": k, "value": v} for k, v in
                                 sandbox_env(spec, "$(POD_IP)", runtime.SANDBOX_PORT, names.TMP_MOUNT)),
                {"name": "HOME", "value": names.TMP_MOUNT}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "ports": _container_ports(spec, Role.SANDBOX),
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": runtime.SANDBOX_PORT}, "periodSeconds": 2,
                           "failureThreshold": 3},
        "volumeMounts": [{"name": names.VOLUME_TMP, "mountPath": names.TMP_MOUNT}],
    }
    resources = _resources(spec, Role.SANDBOX)
    if resources:
        container["resources"] = resources
    tmp: dict[str, Any] = {}
    disk = resources.get("limits", {}).get("ephemeral-storage")
    if disk is not None:
        tmp["sizeLimit"] = disk
    volumes = [{"name": names.VOLUME_TMP, "emptyDir": tmp}]
    pod = _pod(job, Role.SANDBOX, index, container, volumes, {names.ANNOTATION_ATTEMPT: str(attempt)})
    ps = pod["spec"]
    for key in ("runAsUser", "runAsGroup", "fsGroup"):
        ps["securityContext"][key] = ps["securityContext"].get(key) if key in _template_security(spec) \
            else SANDBOX_RUN_AS
    ps["automountServiceAccountToken"] = False
    if pool.runtime_class_name and "runtimeClassName" not in ps:
        ps["runtimeClassName"] = pool.runtime_class_name
    return pod


def _template_security(spec: TrainingJobSpec) -> set[str]:
    """The pod securityContext keys spec.sandbox.template sets (kept over the sandbox's own uid)."""
    tpl = spec.sandbox.template
    if tpl is None or tpl.spec is None or tpl.spec.security_context is None:
        return set()
    return set(tpl.spec.security_context.model_dump(by_alias=True, exclude_unset=True))


def _core_env(job: JobRef, role: str, index: int, resume_checkpoint: str | None = None) -> list[dict]:
    """The lifecycle's role env as pod env, after the password (from a Secret) and POD_IP (downward API)."""
    pairs = role_env(job.spec, role, index, addresses(job), resume_checkpoint)
    return [*_password_env(job), _pod_ip_env(), *_tracker_key_env(job, role),
            *({"name": k, "value": v} for k, v in pairs)]


def _tracker_key_env(job: JobRef, role: str) -> list[dict]:
    """The trainer's W&B API key by reference to the user's Secret (spec.tracking.wandb.apiKeySecret): the key itself
    is in no manifest the operator writes."""
    wandb = job.spec.tracking.wandb
    if role != Role.TRAINER or wandb is None or wandb.api_key_secret is None:
        return []
    ref = {"name": wandb.api_key_secret.name, "key": wandb.api_key_secret.key}
    return [{"name": runtime.ENV_WANDB_API_KEY, "valueFrom": {"secretKeyRef": ref}}]


IMAGE_REGISTRY: str | None = None
"""The operator's `--image-registry` (the chart's `imageRegistry`), set once at start: the project's published role
images are pulled from there (lifecycle/image_reference.relocate)."""


def role_image(spec: TrainingJobSpec, role: str) -> str:
    """The image a role's pods run: the spec's (`image_for`), relocated to IMAGE_REGISTRY when it is ours."""
    return image_reference.relocate(spec.image_for(role), IMAGE_REGISTRY)


def core_pod(job: JobRef, role: str, index: int, attempt: int = 0, resume_checkpoint: str | None = None) -> dict:
    """Pod `index` of a core role: `python -m rlkube.core.<role>` with the runtime.py environment, built by the
    role's own function (`_CORE_PODS`) over the container every core role shares (`_core_container`)."""
    build = _CORE_PODS.get(role)
    if build is None:
        raise ValueError(f"not a core role: {role!r}")
    return build(job, index, attempt, resume_checkpoint)


def _trainer_pod(job: JobRef, index: int, attempt: int, resume_checkpoint: str | None) -> dict:
    """A trainer pod: shared memory, the checkpoint volume, the engine's probe when inference is colocated, the
    Fast-LLM container for that backend, and the checkpoint it must resume from (env and annotation)."""
    spec = job.spec
    # A trainer gets the checkpoint it must resume from (the annotation below) in its env, so that it fails instead
    # of starting over when the volume lost it (rlkube.contract.checkpoint_loss).
    container, volumes = _core_container(job, Role.TRAINER, index, resume_checkpoint, shm=True, engine=colocated(spec))
    ckpt = spec.trainer.checkpoint
    container["volumeMounts"].append({"name": names.VOLUME_CHECKPOINTS, "mountPath": ckpt.path})
    volumes.append(
        {"name": names.VOLUME_CHECKPOINTS, "persistentVolumeClaim": {"claimName": ckpt.claim_name}}
        if ckpt.claim_name
        else {"name": names.VOLUME_CHECKPOINTS, "emptyDir": {}}
    )
    if spec.trainer.backend == Backend.FAST_LLM:
        container = fastllm.trainer_container(container, spec, job.name, index, MASTER_PORT)
    annotations = {names.ANNOTATION_ATTEMPT: str(attempt)}
    if resume_checkpoint:
        annotations[names.ANNOTATION_RESUME] = resume_checkpoint
    return _core_role_pod(job, Role.TRAINER, index, container, volumes, annotations)


def _inference_pod(job: JobRef, index: int, attempt: int, resume_checkpoint: str | None) -> dict:
    """An inference pod: shared memory and the engine's readiness probe."""
    container, volumes = _core_container(job, Role.INFERENCE, index, shm=True, engine=True)
    return _core_role_pod(job, Role.INFERENCE, index, container, volumes, {names.ANNOTATION_ATTEMPT: str(attempt)})


def _preprocessor_pod(job: JobRef, index: int, attempt: int, resume_checkpoint: str | None) -> dict:
    """A preprocessor pod: the shared core container, nothing of its own."""
    container, volumes = _core_container(job, Role.PREPROCESSOR, index)
    return _core_role_pod(job, Role.PREPROCESSOR, index, container, volumes, {names.ANNOTATION_ATTEMPT: str(attempt)})


def _actor_pod(job: JobRef, index: int, attempt: int, resume_checkpoint: str | None) -> dict:
    """An actor pod: the shared core container (its model and dataset volumes come with MODEL_ROLES and
    DATASET_ROLES)."""
    container, volumes = _core_container(job, Role.ACTOR, index)
    return _core_role_pod(job, Role.ACTOR, index, container, volumes, {names.ANNOTATION_ATTEMPT: str(attempt)})


_CORE_PODS: dict[str, Callable[[JobRef, int, int, str | None], dict]] = {
    Role.TRAINER: _trainer_pod,
    Role.INFERENCE: _inference_pod,
    Role.PREPROCESSOR: _preprocessor_pod,
    Role.ACTOR: _actor_pod,
}
"""Each core role's pod builder (the keys are lifecycle.roles.CORE_ROLES)."""


def _core_container(
    job: JobRef, role: str, index: int, resume_checkpoint: str | None = None, shm: bool = False, engine: bool = False
) -> tuple[dict, list[dict]]:
    """(container, volumes) every core role's pod has: the role's module and env, the config and /tmp volumes, the
    model and dataset volumes where the role reads them, its ports; `shm` a memory-backed /dev/shm, `engine` the
    inference engine's readiness probe."""
    container: dict[str, Any] = {
        "name": str(role),
        "image": role_image(job.spec, role),
        "command": ["python", "-m", role_module(job.spec, role)],
        # HOME on the writable /tmp volume (caches of torch, triton, HF); a template's env may point it elsewhere.
        "env": [*_core_env(job, role, index, resume_checkpoint), {"name": "HOME", "value": names.TMP_MOUNT}],
        # The role writes why it failed to /dev/termination-log (rlkube.core.errors); a crash that could not
        # write it still leaves the end of its log, and either lands in the job's Failed condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            {"name": names.VOLUME_CONFIG, "mountPath": names.CONFIG_MOUNT, "readOnly": True},
            {"name": names.VOLUME_TMP, "mountPath": names.TMP_MOUNT},
        ],
    }
    resources = _resources(job.spec, role)
    if resources:
        container["resources"] = resources
    volumes: list[dict] = [
        {"name": names.VOLUME_CONFIG, "configMap": {"name": names.config_name(job.name)}},
        {"name": names.VOLUME_TMP, "emptyDir": {}},
    ]
    if shm:
        # NCCL, torch and vLLM use shared memory; a container runtime's default /dev/shm is 64 MiB.
        container["volumeMounts"].append({"name": names.VOLUME_SHM, "mountPath": names.SHM_MOUNT})
        volumes.append({"name": names.VOLUME_SHM, "emptyDir": {"medium": "Memory"}})
    mounts, data = data_volumes(job.spec, role)
    container["volumeMounts"] += mounts
    volumes += data
    if role in MODEL_ROLES:
        container["env"].append({"name": runtime.ENV_HF_OFFLINE, "value": "1"})
    if engine:
        # The engine's port; Ready once it joined the trainer's group (/health): for a colocated trainer pod too,
        # which is what the actors wait for (lifecycle.roles).
        container["readinessProbe"] = {
            "httpGet": {"path": "/health", "port": runtime.INFERENCE_PORT},
            "periodSeconds": 2,
            "failureThreshold": 3,
        }
    if role in ROLE_PORTS:
        container["ports"] = _container_ports(job.spec, role)
    return container, volumes


def _core_role_pod(job: JobRef, role: str, index: int, container: dict, volumes: list[dict], annotations: dict) -> dict:
    """The pod around a core role's container, with the model's init container where the role loads it."""
    return with_model_init(_pod(job, role, index, container, volumes, annotations), job.spec, role)


def pod(
    job: JobRef, role: str, index: int, attempt: int = 0, resume_checkpoint: str | None = None,
    placement: Placement | None = None,
) -> dict:
    """Pod `index` of `role`; `placement` is where a queue (Kueue) admitted the role, applied last."""
    if role == Role.REDIS:
        return with_placement(redis_pod(job, attempt), placement)
    if role == Role.SANDBOX:
        return with_placement(sandbox_pod(job, index, attempt), placement)
    return with_placement(core_pod(job, role, index, attempt, resume_checkpoint), placement)


def all_children(job: JobRef, password: str | None = None) -> list[dict]:
    """Every child of a freshly started job, in creation order (used by tests and the docs)."""
    pods = [pod(job, role, i) for role in START_ORDER for i in range(replicas(job.spec, role))]
    return static_children(job, password) + pods
