"""The model in the operator's pods (docs/design.md §3): the init container that materializes spec.model.path, the
model cache, model and dataset volumes, their validation, and an init container's failure read as the pod's exit."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.manifests import builders, names
from rlkube.controller.manifests.builders import JobRef
from rlkube.controller.decisions.observed import pod_view
from rlkube.contract import runtime
from rlkube.lifecycle.roles import CORE_ROLES, MODEL_ROLES
from support.specs import spec as raw_spec

DATASET = {"path": "/data/prompts.jsonl", "claimName": "prompts"}
REWARD = {"type": "exact"}


HF_MODEL = "hf://org/tiny"  # a model to fetch: the built-in one has no init container (below)


def ref(**overrides) -> JobRef:
    raw = raw_spec(**{"model.path": HF_MODEL, **overrides})
    return JobRef("ns", "tj", "uid-1", parse_spec(raw), raw)


def pod(job: JobRef, role: str) -> dict:
    return builders.pod(job, role, 0)


def main_container(p: dict) -> dict:
    role = p["metadata"]["labels"][names.LABEL_ROLE]
    return next(c for c in p["spec"]["containers"] if c["name"] == role)


def env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def volumes(p: dict) -> dict[str, dict]:
    return {v["name"]: v for v in p["spec"].get("volumes", [])}


def mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def field_errors(raw: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    return {e.field: e.message for e in err.value.errors}


@pytest.mark.parametrize("role", CORE_ROLES)
def test_a_built_in_model_has_no_init_container_and_each_role_writes_it_into_its_cache(role):
    """builtin:// has nothing to fetch or check: the role writes it from the seed (rlkube.core.hf.source), so an
    init container would only cost another container start per pod."""
    p = pod(ref(**{"model.path": "builtin://tiny-llama"}), role)
    assert "initContainers" not in p["spec"]
    if role in MODEL_ROLES:
        assert names.VOLUME_MODEL_CACHE in volumes(p)
        assert env(main_container(p))[runtime.ENV_MODEL_CACHE]["value"] == names.MODEL_CACHE_MOUNT


@pytest.mark.parametrize("role", CORE_ROLES)
def test_every_pod_that_loads_the_model_fetches_it_first_in_an_init_container(role):
    p = pod(ref(), role)
    if role not in MODEL_ROLES:  # the preprocessor works on token ids
        assert "initContainers" not in p["spec"] and names.VOLUME_MODEL_CACHE not in volumes(p)
        assert runtime.ENV_MODEL_CACHE not in env(main_container(p))
        return
    (init,) = p["spec"]["initContainers"]
    main = main_container(p)
    assert init["name"] == names.INIT_MODEL
    assert init["command"] == ["python", "-m", "rlkube.core.hf.fetch"]
    assert init["image"] == main["image"] and init["securityContext"] == main["securityContext"]
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # Modest resources, never the role's GPUs, never more than the role's own requests (below).
    assert set(init["resources"].get("requests", {})) <= set((main.get("resources") or {}).get("requests") or {})
    # Both see the cache at the same place; only the role is offline (the init container is the one that fetches).
    for c in (init, main):
        assert env(c)[runtime.ENV_MODEL_CACHE]["value"] == names.MODEL_CACHE_MOUNT
        assert env(c)[runtime.ENV_CONFIG]["value"] == f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}"
        assert mounts(c)[names.VOLUME_MODEL_CACHE] == {"name": names.VOLUME_MODEL_CACHE,
                                                       "mountPath": names.MODEL_CACHE_MOUNT}
    assert env(main)[runtime.ENV_HF_OFFLINE]["value"] == "1"
    assert runtime.ENV_HF_OFFLINE not in env(init)
    assert init["volumeMounts"] == main["volumeMounts"]
    # emptyDir by default: each pod materializes its own copy.
    assert volumes(p)[names.VOLUME_MODEL_CACHE] == {"name": names.VOLUME_MODEL_CACHE, "emptyDir": {}}


def test_a_fast_llm_trainer_still_fetches_with_the_job_config():
    # Fast-LLM's container env is its own (no RLKUBE_CONFIG): the init container gets what the fetch reads.
    job = ref(**{"trainer.backend": "fast-llm", "trainer.gpusPerNode": 1, "trainer.fastLlm": {"modelFormat": "llama"},
                 "model.path": "/models/llama", "model.claimName": "models", "inference.engine": "vllm"})
    p = pod(job, "trainer")
    (init,) = p["spec"]["initContainers"]
    assert env(init)[runtime.ENV_CONFIG]["value"] == f"{names.CONFIG_MOUNT}/{names.CONFIG_KEY}"
    assert env(init)[runtime.ENV_MODEL_CACHE]["value"] == names.MODEL_CACHE_MOUNT
    assert mounts(init)[names.VOLUME_MODEL]["readOnly"] is True


def test_gpu_pods_fetch_without_gpus():
    p = pod(ref(**{"trainer.gpusPerNode": 1}), "trainer")
    assert main_container(p)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(p["spec"]["initContainers"][0]["resources"])


@pytest.mark.parametrize(("requests", "init"), [
    ({"cpu": "1", "memory": "1Gi"}, {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}),
    ({"cpu": "100m", "memory": "256Mi"}, {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}),
    ({"cpu": "2"}, {"requests": {"cpu": "250m"}}),
    (None, {}),  # the actor asks for nothing (tiny-cpu): nor does its fetch, which would reserve 250m for the pod's life
])
def test_the_fetch_never_asks_more_than_its_role(requests, init):
    overrides = {"actor.resources": {"requests": requests}} if requests else {}
    p = pod(ref(**overrides), "actor")
    assert p["spec"]["initContainers"][0]["resources"] == init


def test_the_init_container_carries_what_the_template_adds_to_the_role():
    template = {"spec": {
        "securityContext": {"runAsUser": 4242},
        "volumes": [{"name": "ca", "configMap": {"name": "corp-ca"}}],
        "containers": [{"name": "inference",
                        "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                                {"name": "HF_ENDPOINT", "value": "https://mirror.example/hf"},
                                {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
                        "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/corp", "readOnly": True}],
                        "securityContext": {"readOnlyRootFilesystem": False}}],
    }}
    p = pod(ref(**{"inference.template": template}), "inference")
    (init,) = p["spec"]["initContainers"]
    e = env(init)
    assert e["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert e["HF_ENDPOINT"]["value"] == "https://mirror.example/hf" and e["HTTPS_PROXY"]["value"] == "http://proxy:3128"
    assert mounts(init)["ca"]["mountPath"] == "/etc/ssl/corp"
    assert init["securityContext"]["readOnlyRootFilesystem"] is False
    assert p["spec"]["securityContext"]["runAsUser"] == 4242  # pod-level: shared by the init container


@pytest.mark.parametrize("value", ["1", "0"])
def test_a_templates_hf_hub_offline_is_the_fetchs_the_role_is_always_offline(value):
    template = {"spec": {"containers": [{"name": "trainer", "env": [{"name": "HF_HUB_OFFLINE", "value": value}]}]}}
    p = pod(ref(**{"model.path": "hf://org/tiny", "trainer.template": template}), "trainer")
    assert env(p["spec"]["initContainers"][0])["HF_HUB_OFFLINE"]["value"] == value
    assert [e["value"] for e in main_container(p)["env"] if e["name"] == "HF_HUB_OFFLINE"] == ["1"]


def test_a_shared_cache_claim_replaces_the_emptydir_in_every_model_pod():
    job = ref(**{"model.path": "hf://org/tiny", "model.cacheClaimName": "model-cache"})
    for role in MODEL_ROLES:
        assert volumes(pod(job, role))[names.VOLUME_MODEL_CACHE] == {
            "name": names.VOLUME_MODEL_CACHE, "persistentVolumeClaim": {"claimName": "model-cache"}}


def test_model_and_dataset_claims_are_mounted_read_only_where_they_are_read():
    job = ref(**{"model.path": "/weights/qwen", "model.claimName": "qwen", "model.mountPath": "/weights",
                 "task.dataset": DATASET, "task.reward": REWARD})
    for role in CORE_ROLES:
        p = pod(job, role)
        vols, main = volumes(p), main_container(p)
        if role in MODEL_ROLES:
            assert vols[names.VOLUME_MODEL] == {"name": names.VOLUME_MODEL, "persistentVolumeClaim": {
                "claimName": "qwen", "readOnly": True}}
            for c in (main, p["spec"]["initContainers"][0]):
                assert mounts(c)[names.VOLUME_MODEL] == {"name": names.VOLUME_MODEL, "mountPath": "/weights",
                                                         "readOnly": True}
        else:
            assert names.VOLUME_MODEL not in vols
        if role == "actor":
            assert vols[names.VOLUME_DATASET] == {"name": names.VOLUME_DATASET, "persistentVolumeClaim": {
                "claimName": "prompts", "readOnly": True}}
            assert mounts(main)[names.VOLUME_DATASET] == {"name": names.VOLUME_DATASET, "mountPath": "/data",
                                                          "readOnly": True}
        else:
            assert names.VOLUME_DATASET not in vols


def test_no_claims_no_claim_volumes():
    for role in CORE_ROLES:
        vols = volumes(pod(ref(), role))
        assert names.VOLUME_MODEL not in vols and names.VOLUME_DATASET not in vols


@pytest.mark.parametrize(("overrides", "field", "words"), [
    ({"model.claimName": "m"}, "spec.model.claimName", "is not a directory"),  # builtin:// with a claim
    ({"model.path": "hf://org/name", "model.claimName": "m"}, "spec.model.claimName", "is not a directory"),
    ({"model.path": "/elsewhere/m", "model.claimName": "m"}, "spec.model.path", "must lie below mountPath /models"),
    ({"model.path": "models/m", "model.claimName": "m"}, "spec.model.path", "must lie below mountPath"),
    ({"model.path": "/tmp/m", "model.claimName": "m", "model.mountPath": "/tmp"}, "spec.model.mountPath",
     "/tmp holds"),
    ({"model.path": "/checkpoints/m", "model.claimName": "m", "model.mountPath": "/checkpoints"},
     "spec.model.mountPath", "spec.trainer.checkpoint.path"),
    ({"model.path": "/data/m", "model.claimName": "m", "model.mountPath": "/data", "task.dataset": DATASET,
      "task.reward": REWARD}, "spec.task.dataset.mountPath", "spec.model.mountPath"),
    ({"task.dataset": {"path": "/elsewhere/p.jsonl", "claimName": "p"}, "task.reward": REWARD},
     "spec.task.dataset.path", "must lie below mountPath /data"),
    ({"model.path": "hf://not a repo"}, "spec.model.path", "not hf://org/name"),
])
def test_model_and_dataset_volume_rules_name_the_field(overrides, field, words):
    errors = field_errors(raw_spec(**overrides))
    assert field in errors and words in errors[field], errors


def test_a_model_on_a_claim_may_be_the_claims_root_or_below_it():
    for path in ("/models", "/models/qwen", "/models/org/qwen/"):
        parse_spec(raw_spec(**{"model.path": path, "model.claimName": "m"}))


@pytest.mark.parametrize(("role", "tpl", "where"), [
    ("trainer", {"volumes": [{"name": names.VOLUME_MODEL_CACHE, "emptyDir": {}}]},
     f"spec.trainer.template.spec.volumes[{names.VOLUME_MODEL_CACHE}]"),
    ("actor", {"volumes": [{"name": names.VOLUME_DATASET, "emptyDir": {}}]},
     f"spec.actor.template.spec.volumes[{names.VOLUME_DATASET}]"),
    ("inference", {"containers": [{"name": "inference", "env": [{"name": runtime.ENV_MODEL_CACHE, "value": "/x"}]}]},
     f"spec.inference.template.spec.containers[inference].env[{runtime.ENV_MODEL_CACHE}]"),
    ("actor", {"volumes": [{"name": "x", "emptyDir": {}}],
               "containers": [{"name": "actor", "volumeMounts": [{"name": "x", "mountPath": names.MODEL_CACHE_MOUNT}]}]},
     f"spec.actor.template.spec.containers[actor].volumeMounts[{names.MODEL_CACHE_MOUNT}]"),
])
def test_templates_cannot_take_the_model_volumes_mounts_or_env(role, tpl, where):
    assert where in field_errors(raw_spec(**{f"{role}.template": {"spec": tpl}}))


def test_templates_cannot_add_init_containers():
    errors = field_errors(raw_spec(**{"trainer.template": {"spec": {"initContainers": [{"name": "x"}]}}}))
    assert any("initContainers" in f for f in errors), errors


# -- an init container's failure is the pod's exit -----------------------------------------------------------


def _raw_pod(phase: str, init: dict, main_state: dict, main_restarts: int = 0) -> dict:
    return {
        "metadata": {"name": "tj-inference-0", "uid": "u1",
                     "labels": {"rlkube.io/role": "inference", "rlkube.io/index": "0", "rlkube.io/job-name": "tj"}},
        "status": {
            "phase": phase,
            "initContainerStatuses": [{"name": names.INIT_MODEL, **init}],
            "containerStatuses": [{"name": "inference", "restartCount": main_restarts, "state": main_state,
                                   "lastState": {}}],
        },
    }


WAITING_MAIN = {"waiting": {"reason": "PodInitializing"}}
FAILED = {"exitCode": 78, "message": "spec.model.path: /models/x does not exist", "reason": "Error",
          "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:09Z"}


def test_an_init_container_failing_under_restart_policy_never_is_the_pods_exit():
    view = pod_view(_raw_pod("Failed", {"restartCount": 0, "state": {"terminated": FAILED}}, WAITING_MAIN))
    assert view.exit_code == 78 and view.termination_message == FAILED["message"]
    assert view.finished_at == datetime(2025, 1, 1, 0, 0, 9, tzinfo=UTC) and view.terminated


def test_an_init_container_crash_looping_in_place_counts_its_restarts_and_last_exit():
    view = pod_view(_raw_pod("Pending", {"restartCount": 3, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                         "lastState": {"terminated": FAILED}}, WAITING_MAIN))
    assert view.restart_count == 3 and view.last_exit_code == 78 and view.exit_code is None
    assert view.termination_message == FAILED["message"] and view.waiting_reason == "Init:CrashLoopBackOff"


def test_a_running_fetch_and_a_role_that_ran_are_read_from_the_role():
    fetching = pod_view(_raw_pod("Pending", {"restartCount": 0, "state": {"running": {}}}, WAITING_MAIN))
    assert fetching.exit_code is None and fetching.restart_count == 0 and fetching.waiting_reason == "PodInitializing"
    # The fetch failed once, then worked; the role ran and failed itself: the role's exit is the pod's.
    role_failed = pod_view(_raw_pod(
        "Failed", {"restartCount": 1, "state": {"terminated": {"exitCode": 0}}, "lastState": {"terminated": FAILED}},
        {"terminated": {"exitCode": 1, "message": "boom"}}))
    assert role_failed.exit_code == 1 and role_failed.termination_message == "boom"


def _init_failure_view(code: int, restarts: int, role: str = "inference"):
    raw = _raw_pod("Pending", {"restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                               "lastState": {"terminated": {**FAILED, "exitCode": code}}}, WAITING_MAIN)
    raw["metadata"].update(name=f"j-{role}-0", uid=f"uid-j-{role}-0")
    raw["metadata"]["labels"]["rlkube.io/role"] = role
    raw["status"]["containerStatuses"][0]["name"] = role
    return pod_view(raw)


def test_a_fetch_exiting_78_fails_the_job_at_once_with_its_message():
    from test_controller_decisions import all_pods, cond, job, outcome_of, run, running_status

    d = run(job(running_status()), all_pods(inference=_init_failure_view(runtime.EXIT_CONFIG, restarts=1)))
    assert outcome_of(d) == ("Failed", "InvalidSpec")
    assert "spec.model.path: /models/x does not exist" in cond(d.status, "Failed").message


@pytest.mark.parametrize(("role", "limit", "reason"), [("inference", "runPolicy.componentBackoffLimit",
                                                         "ComponentBackoffLimitExceeded"),
                                                        ("trainer", "runPolicy.backoffLimit", "BackoffLimitExceeded")])
def test_a_crash_looping_fetch_counts_against_the_restart_budget(role, limit, reason):
    from test_controller_decisions import all_pods, job, outcome_of, run, running_status

    within = run(job(running_status(), **{limit: 2}), all_pods(**{role: _init_failure_view(1, restarts=2, role=role)}))
    assert outcome_of(within) is None and within.status.components[role].restarts == 2
    beyond = run(job(running_status(), **{limit: 2}), all_pods(**{role: _init_failure_view(1, restarts=3, role=role)}))
    assert outcome_of(beyond) == ("Failed", reason)
