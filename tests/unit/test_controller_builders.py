"""The pure builders: every child manifest of a TrainingJob, as the contract in docs/design.md §3 fixes it."""

from __future__ import annotations

import json
from pathlib import Path

from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import builders
from rlkube.controller.manifests.builders import JobRef
from rlkube.lifecycle.roles import CORE_ROLES
from support import specs


def ref(**overrides) -> JobRef:
    raw = specs.spec(**overrides)
    return JobRef("ns", "tj", "uid-1", parse_spec(raw), raw)


def by_name(manifests: list[dict]) -> dict[str, dict]:
    return {f"{m['kind']}/{m['metadata']['name']}": m for m in manifests}


def env_of(pod: dict) -> dict[str, dict]:
    return {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}


def test_managed_job_children_names_labels_and_owner():
    kids = by_name(builders.all_children(ref(), password="s3cret"))
    assert set(kids) == {
        "ConfigMap/tj-config", "Secret/tj-redis", "NetworkPolicy/tj-redis", "Service/tj-redis", "Service/tj-inference",
        "Service/tj-trainer",
        "Pod/tj-redis", "Pod/tj-trainer-0", "Pod/tj-inference-0", "Pod/tj-preprocessor-0", "Pod/tj-actor-0",
    }
    for key, m in kids.items():
        meta = m["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["ownerReferences"] == [{"apiVersion": "rlkube.io/v1alpha1", "kind": "TrainingJob", "name": "tj",
                                            "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "rlkube"
        assert meta["labels"]["app.kubernetes.io/name"] == "rlkube"
        assert meta["labels"]["rlkube.io/job-name"] == "tj"
        if m["kind"] == "Pod":
            assert meta["labels"]["rlkube.io/index"] == "0" and "rlkube.io/role" in meta["labels"], key
    assert kids["Secret/tj-redis"]["stringData"] == {"password": "s3cret"}


def test_services_are_headless_with_port_equal_to_target_port():
    for svc in builders.services(ref()):
        spec = svc["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
        assert all(p["port"] == p["targetPort"] for p in spec["ports"])
        assert spec["selector"] == {"rlkube.io/job-name": "tj", "rlkube.io/role": svc["metadata"]["labels"]["rlkube.io/role"]}
    ports = {s["metadata"]["name"]: [p["port"] for p in s["spec"]["ports"]] for s in builders.services(ref())}
    assert ports == {"tj-redis": [6379], "tj-inference": [8000], "tj-trainer": [29500, 29400]}


def test_config_map_holds_the_job_config_in_runtime_format():
    job = ref()
    doc = json.loads(builders.config_map(job)["data"]["job.json"])
    assert doc == {"namespace": "ns", "name": "tj", "uid": "uid-1", "spec": job.raw_spec}  # uid: the run (docs/design.md §5.7)
    import tempfile

    from rlkube.contract.runtime import write_job_config

    with tempfile.TemporaryDirectory() as d:
        written = write_job_config(Path(d) / "job.json", "ns", "tj", job.raw_spec, uid=job.uid).read_text()
    assert written == builders.config_map(job)["data"]["job.json"]


def test_core_pods_run_their_role_with_the_runtime_environment():
    job = ref()
    for role in CORE_ROLES:
        pod = builders.core_pod(job, role, 0)
        c = pod["spec"]["containers"][0]
        assert c["command"] == ["python", "-m", f"rlkube.core.{role}"]
        assert c["image"] == "ghcr.io/rlkube/core:0.1.0"
        env = env_of(pod)
        assert env["RLKUBE_CONFIG"]["value"] == "/etc/rlkube/job.json"
        assert env["RLKUBE_REDIS_URL"]["value"] == "redis://tj-redis:6379/0"
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "tj-redis", "key": "password"}
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("RLKUBE_BIND_HOST")  # $(POD_IP) only expands from earlier vars
        assert env["RLKUBE_INDEX"]["value"] == "0"
        assert {"mountPath": "/etc/rlkube", "name": "job-config", "readOnly": True} in c["volumeMounts"]
        assert pod["spec"]["terminationGracePeriodSeconds"] == getattr(job.spec.teardown.grace_period_seconds, role)
        assert pod["spec"]["restartPolicy"] == "OnFailure"
        assert pod["spec"]["enableServiceLinks"] is False
        if role in ("trainer", "inference"):
            assert pod["spec"]["hostname"] == f"tj-{role}-0" and pod["spec"]["subdomain"] == f"tj-{role}"
            assert env["RLKUBE_WEIGHT_SYNC_ADDR"]["value"] == "tj-trainer-0.tj-trainer:29500"
        else:
            assert "hostname" not in pod["spec"] and "RLKUBE_WEIGHT_SYNC_ADDR" not in env
    actor = env_of(builders.core_pod(job, "actor", 0))
    assert actor["RLKUBE_INFERENCE_URLS"]["value"] == "http://tj-inference-0.tj-inference:8000"
    inference = builders.core_pod(job, "inference", 0)["spec"]["containers"][0]
    assert inference["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert env_of(builders.core_pod(job, "inference", 0))["RLKUBE_PORT"]["value"] == "8000"
    assert inference["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}}


def test_trainer_pod_checkpoint_volume_rank_env_and_gpus():
    pod = builders.core_pod(ref(), "trainer", 0)
    env = env_of(pod)
    assert env["RLKUBE_CHECKPOINT_DIR"]["value"] == "/checkpoints" and env["RLKUBE_PORT"]["value"] == "29500"
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}

    job = ref(**{"trainer.nodes": 3, "trainer.gpusPerNode": 2, "trainer.checkpoint.claimName": "ckpt",
                 "trainer.checkpoint.path": "/data/ckpt", "trainer.image": "ghcr.io/rlkube/trainer-megatron:1"})
    ranks = [builders.core_pod(job, "trainer", i) for i in range(3)]
    for i, p in enumerate(ranks):
        e = env_of(p)
        # Two ranks per pod: the launcher gives each its RANK/LOCAL_RANK (environment.rank_env), not the pod.
        assert (e["WORLD_SIZE"]["value"], e["NODE_RANK"]["value"], e["LOCAL_WORLD_SIZE"]["value"]) == ("6", str(i), "2")
        assert "RANK" not in e and "LOCAL_RANK" not in e
        assert e["MASTER_ADDR"]["value"] == "tj-trainer-0.tj-trainer" and e["MASTER_PORT"]["value"] == "29400"
        c = p["spec"]["containers"][0]
        assert c["image"] == "ghcr.io/rlkube/trainer-megatron:1"
        assert c["command"] == ["python", "-m", "rlkube.core.launch.ranks"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
        vols = {v["name"]: v for v in p["spec"]["volumes"]}
        assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
        assert {"name": "checkpoints", "mountPath": "/data/ckpt"} in c["volumeMounts"]
    assert builders.pod_names(job, "trainer") == ["tj-trainer-0", "tj-trainer-1", "tj-trainer-2"]


def test_redis_pod_command_probe_and_secret():
    pod = builders.redis_pod(ref())
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["redis-server", "--port", "6379", "--bind", "$(POD_IP)", "--requirepass",
                            "$(REDIS_PASSWORD)", "--save", "", "--appendonly", "no"]
    assert c["image"] == "redis:7-alpine"
    assert c["readinessProbe"]["tcpSocket"] == {"port": 6379}
    env = env_of(pod)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "tj-redis", "key": "password"}
    assert pod["metadata"]["name"] == "tj-redis"
    assert pod["spec"]["hostname"] == "tj-redis" and pod["spec"]["subdomain"] == "tj-redis"


def test_external_redis_has_no_redis_children_and_passes_the_users_secret():
    job = ref(**{"redis.mode": "external", "redis.url": "redis://shared:6379/3",
                 "redis.passwordSecret": {"name": "shared-redis", "key": "pw"}})
    kids = by_name(builders.all_children(job, password="unused"))
    assert not any("redis" in k for k in kids)
    env = env_of(kids["Pod/tj-actor-0"])
    assert env["RLKUBE_REDIS_URL"]["value"] == "redis://shared:6379/3"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "shared-redis", "key": "pw"}
    no_secret = ref(**{"redis.mode": "external", "redis.url": "redis://shared:6379/3"})
    assert "REDIS_PASSWORD" not in env_of(builders.core_pod(no_secret, "actor", 0))


def test_restart_policy_and_replicas_follow_the_spec():
    job = ref(**{"runPolicy.restartPolicy.actor": "Never", "actor.replicas": 3, "inference.replicas": 2})
    kids = by_name(builders.all_children(job, password="p"))
    assert [k for k in kids if k.startswith("Pod/tj-actor")] == ["Pod/tj-actor-0", "Pod/tj-actor-1", "Pod/tj-actor-2"]
    assert kids["Pod/tj-actor-2"]["spec"]["restartPolicy"] == "Never"
    assert env_of(kids["Pod/tj-actor-1"])["RLKUBE_INDEX"]["value"] == "1"
    urls = env_of(kids["Pod/tj-actor-0"])["RLKUBE_INFERENCE_URLS"]["value"].split(",")
    assert urls == ["http://tj-inference-0.tj-inference:8000", "http://tj-inference-1.tj-inference:8000"]
    assert kids["Pod/tj-redis"]["spec"]["restartPolicy"] == "Always"


def test_builders_are_pure():
    job = ref()
    assert builders.all_children(job, "p") == builders.all_children(job, "p")
    resumed = builders.core_pod(job, "trainer", 0, resume_checkpoint="/checkpoints/step-10")
    assert resumed["metadata"]["annotations"]["rlkube.io/resume-from-checkpoint"] == "/checkpoints/step-10"
