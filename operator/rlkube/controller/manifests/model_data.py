"""The model and the data a core role reads: their volumes (model cache, model claim, dataset claim), and the init
container that materializes spec.model.path into the model cache before the role starts (rlkube.core.hf.fetch).

Apart from builders.py, whose pods use them, as the one place that says what a role gets of the model and dataset.
"""

from __future__ import annotations

import copy

from rlkube.api.model_path import parse_model_path
from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import runtime
from rlkube.controller.manifests import names
from rlkube.lifecycle.pod_checks import parse_quantity
from rlkube.lifecycle.roles import DATASET_ROLES, MODEL_ROLES


def data_volumes(spec: TrainingJobSpec, role: str) -> tuple[list[dict], list[dict]]:
    """(mounts, volumes) of the model cache, the model claim and the dataset claim, where `role` reads them."""
    mounts: list[dict] = []
    volumes: list[dict] = []
    if role in MODEL_ROLES:
        cache = spec.model.cache_claim_name
        mounts.append({"name": names.VOLUME_MODEL_CACHE, "mountPath": names.MODEL_CACHE_MOUNT})
        volumes.append({"name": names.VOLUME_MODEL_CACHE, "persistentVolumeClaim": {"claimName": cache}}
                       if cache else {"name": names.VOLUME_MODEL_CACHE, "emptyDir": {}})
        if spec.model.claim_name:
            mounts.append({"name": names.VOLUME_MODEL, "mountPath": spec.model.mount_path, "readOnly": True})
            volumes.append({"name": names.VOLUME_MODEL, "persistentVolumeClaim": {
                "claimName": spec.model.claim_name, "readOnly": True}})
    ds = spec.task.dataset
    if role in DATASET_ROLES and ds is not None and ds.claim_name:
        mounts.append({"name": names.VOLUME_DATASET, "mountPath": ds.mount_path, "readOnly": True})
        volumes.append({"name": names.VOLUME_DATASET, "persistentVolumeClaim": {
            "claimName": ds.claim_name, "readOnly": True}})
    return mounts, volumes


MODEL_INIT_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
"""The model init container downloads (streamed to disk) and parses a config and a tokenizer: no GPU, little memory.
At most these, and never more than the role's own container asks (model_init_resources)."""


def model_init_resources(main: dict) -> dict:
    """MODEL_INIT_RESOURCES with each request capped at the role container's own, and dropped where the role asks
    for none. A pod's effective request is the larger of its init and app containers' requests, so a larger init
    request would reserve, for the pod's whole life, capacity that only the seconds-long fetch uses: on a real
    2-CPU node kube-scheduler refused tiny-cpu's second actor for 250m CPU its actor never asked for. The memory
    limit goes with the memory request (a limit alone becomes the request)."""
    own = (main.get("resources") or {}).get("requests") or {}
    requests = {}
    for key, default in MODEL_INIT_RESOURCES["requests"].items():
        if key in own:
            requests[key] = default if parse_quantity(default) <= parse_quantity(own[key]) else own[key]
    out: dict = {"requests": requests} if requests else {}
    if "memory" in requests:
        out["limits"] = dict(MODEL_INIT_RESOURCES["limits"])
    return out


MODEL_INIT_MODULE = "rlkube.core.hf.fetch"


def model_init_container(pod: dict, role: str, keep_offline: bool = False) -> dict:
    """The init container that materializes spec.model.path into the model cache (rlkube.core.hf.fetch).

    Built from the role's container AFTER the pod template was merged, so what a user added there reaches the fetch
    too: HF_TOKEN, HF_ENDPOINT, proxy variables, a CA bundle volume, the security context. It has its own command
    and modest resources, and it may use the network unless the template sets HF_HUB_OFFLINE (`keep_offline`; the
    operator's own HF_HUB_OFFLINE=1 is the role's). It fails like a role: a model that cannot work is written to
    its termination log and it exits runtime.EXIT_CONFIG."""
    main = next(c for c in pod["spec"]["containers"] if c["name"] == role)
    env = [copy.deepcopy(e) for e in main.get("env", []) if keep_offline or e["name"] != runtime.ENV_HF_OFFLINE]
    # What the fetch reads, where the role's own env lacks it (a Fast-LLM trainer's env is Fast-LLM's).
    needed = {runtime.ENV_CONFIG: f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}",
              runtime.ENV_MODEL_CACHE: names.MODEL_CACHE_MOUNT}
    present = {e["name"] for e in env}
    env = [{"name": k, "value": v} for k, v in needed.items() if k not in present] + env
    init = {
        "name": names.INIT_MODEL,
        "image": main["image"],
        "command": ["python", "-m", MODEL_INIT_MODULE],
        "env": env,
        "resources": model_init_resources(main),
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": copy.deepcopy(main.get("volumeMounts", [])),
    }
    if "securityContext" in main:
        init["securityContext"] = copy.deepcopy(main["securityContext"])
    return init


def with_model_init(pod: dict, spec: TrainingJobSpec, role: str) -> dict:
    """`pod` (a built core role pod, its template merged) with the init container that materializes the model, where
    the role loads one that is not built in."""
    if role in MODEL_ROLES and parse_model_path(spec.model.path).kind != "builtin":
        # A built-in model has nothing to fetch or check: each role writes it from the seed into its model cache
        # (rlkube.core.hf.source.write_builtin, atomic), in the process that loads it anyway. An init container
        # would only cost every pod another container start and a second write (~4 s of CPU).
        tpl = spec.template_for(role)
        offline_by_user = tpl is not None and any(
            e.name == runtime.ENV_HF_OFFLINE for c in tpl.spec.containers for e in c.env)
        pod["spec"]["initContainers"] = [model_init_container(pod, role, keep_offline=offline_by_user)]
        # The role uses what the init container materialized, never the network, whatever a template said: a
        # template's HF_HUB_OFFLINE is the fetch's (1 for a pre-filled cache claim in an air-gapped cluster).
        main = next(c for c in pod["spec"]["containers"] if c["name"] == role)
        for e in main["env"]:
            if e["name"] == runtime.ENV_HF_OFFLINE:
                e.clear()
                e.update(name=runtime.ENV_HF_OFFLINE, value="1")
    return pod
