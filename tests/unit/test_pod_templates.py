"""Per-role pod template overrides (`spec.<role>.template`): every field merged by its documented rule
(controller/manifests/podtemplate.py), every refusal naming the field (lifecycle/validation.py,
api/pod_template.py), the hardened defaults of every child, the Redis NetworkPolicy, GPUs, /dev/shm and the
trainer's ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support.pod_security import assert_hardened_pod, assert_no_secret_value, selects

from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.manifests import builders
from rlkube.controller.manifests.builders import JobRef
from rlkube.contract.parallel import rank_env
from rlkube.lifecycle.environment import operator_env_names
from rlkube.lifecycle.roles import START_ORDER
from support import specs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = specs.spec()
ROLES = ("trainer", "inference", "actor", "preprocessor", "redis")


def raw_with(role: str | None = None, template: dict | None = None, **changes) -> dict:
    if role is not None:
        changes = {f"{role}.template": template, **changes}
    return specs.spec(**changes)


def job_of(raw: dict, name: str = "tj") -> JobRef:
    return JobRef("ns", name, "uid-1", parse_spec(raw), raw)


def pod_of(role: str, template: dict, **changes) -> dict:
    return builders.pod(job_of(raw_with(role, template, **changes)), role, 0)


def container(pod: dict) -> dict:
    (c,) = pod["spec"]["containers"]
    return c


def errors_of(raw: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    return {e.field: e.message for e in err.value.errors}


# --- every override field, merged by its rule -----------------------------------------------------------------


@pytest.mark.parametrize("role", ROLES)
def test_metadata_labels_and_annotations_are_added_to_the_operators(role):
    pod = pod_of(role, {"metadata": {"labels": {"team": "rl"}, "annotations": {"example.com/owner": "me"}}})
    meta = pod["metadata"]
    assert meta["labels"]["team"] == "rl" and meta["labels"]["rlkube.io/role"] == role
    assert meta["annotations"]["example.com/owner"] == "me" and meta["annotations"]["rlkube.io/attempt"] == "0"


@pytest.mark.parametrize("role", ROLES)
def test_placement_fields(role):
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                   {"key": "pool", "operator": "Equal", "value": "rl", "effect": "NoExecute",
                    "tolerationSeconds": 30}]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"rlkube.io/job-name": "tj"}}}]
    pod = pod_of(role, {"spec": {"nodeSelector": {"pool": "rl"}, "tolerations": tolerations, "affinity": affinity,
                                 "topologySpreadConstraints": spread, "priorityClassName": "high",
                                 "runtimeClassName": "nvidia"}})
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "rl"}
    assert spec["tolerations"] == tolerations
    assert spec["affinity"] == affinity
    assert spec["topologySpreadConstraints"] == spread
    assert spec["priorityClassName"] == "high" and spec["runtimeClassName"] == "nvidia"


@pytest.mark.parametrize("role", ROLES)
def test_identity_fields(role):
    pod = pod_of(role, {"spec": {"serviceAccountName": "rl-sa",
                                 "imagePullSecrets": [{"name": "regcred"}, {"name": "mirror"}]}})
    assert pod["spec"]["serviceAccountName"] == "rl-sa"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


@pytest.mark.parametrize("role", ROLES)
def test_env_is_appended_after_the_operators_and_may_refer_to_it(role):
    env = [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "MY_IP", "value": "$(POD_IP)"},
           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
           {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    c = container(pod_of(role, {"spec": {"containers": [{"name": role, "env": env}]}}))
    names = [e["name"] for e in c["env"]]
    assert c["env"][-len(env):] == env
    assert names.index("POD_IP") < names.index("MY_IP")  # $(POD_IP) expands only from earlier variables


def test_env_replaces_a_default_of_the_operator_by_name():
    c = container(pod_of("actor", {"spec": {"containers": [{"name": "actor", "env": [
        {"name": "HOME", "value": "/cache"}]}], "volumes": [{"name": "cache", "emptyDir": {}}]}}))
    assert [e for e in c["env"] if e["name"] == "HOME"] == [{"name": "HOME", "value": "/cache"}]


@pytest.mark.parametrize("role", ROLES)
def test_volumes_and_mounts_are_added(role):
    tpl = {"spec": {"volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                                {"name": "models", "configMap": {"name": "models", "defaultMode": 420}}],
                    "containers": [{"name": role, "volumeMounts": [
                        {"name": "data", "mountPath": "/data", "readOnly": True},
                        {"name": "models", "mountPath": "/models", "subPath": "policy"}]}]}}
    pod = pod_of(role, tpl)
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}
    assert vols["models"] == {"name": "models", "configMap": {"name": "models", "defaultMode": 420}}
    mounts = {m["mountPath"]: m for m in container(pod)["volumeMounts"]}
    assert mounts["/data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert mounts["/models"] == {"name": "models", "mountPath": "/models", "subPath": "policy"}
    if role != "redis":
        assert mounts["/etc/rlkube"]["name"] == "job-config"  # the operator's stay


def test_a_template_may_resize_the_operators_tmp_and_shm_volumes():
    pod = pod_of("trainer", {"spec": {"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                                                  {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}}]}})
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert vols["tmp"]["emptyDir"] == {"sizeLimit": "10Gi"}
    assert [v["name"] for v in pod["spec"]["volumes"]].count("dshm") == 1


@pytest.mark.parametrize("role", ROLES)
def test_security_contexts_merge_field_by_field_over_the_hardened_defaults(role):
    tpl = {"spec": {"securityContext": {"runAsUser": 2000, "fsGroup": 3000, "supplementalGroups": [4000],
                                        "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}]},
                    "containers": [{"name": role, "securityContext": {"readOnlyRootFilesystem": False,
                                                                      "seLinuxOptions": {"level": "s0:c1"}}}]}}
    pod = pod_of(role, tpl)
    psc = pod["spec"]["securityContext"]
    assert psc["runAsUser"] == 2000 and psc["fsGroup"] == 3000 and psc["supplementalGroups"] == [4000]
    assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}  # kept
    sc = container(pod)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is False and sc["seLinuxOptions"] == {"level": "s0:c1"}
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}  # kept


def test_trainer_anti_affinity_is_the_operators_until_the_template_gives_its_own():
    gpu = {"trainer.nodes": 2, "trainer.gpusPerNode": 1}
    pod = builders.pod(job_of(raw_with(**gpu)), "trainer", 0)
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term == {"labelSelector": {"matchLabels": {"rlkube.io/job-name": "tj", "rlkube.io/role": "trainer"}},
                    "topologyKey": "kubernetes.io/hostname"}
    cpu = builders.pod(job_of(raw_with(**{"trainer.nodes": 2})), "trainer", 0)
    assert cpu["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0][
        "podAffinityTerm"] == term
    mine = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}}
    pod = pod_of("trainer", {"spec": {"affinity": mine}}, **gpu)
    assert pod["spec"]["affinity"] == mine
    assert "affinity" not in builders.pod(job_of(raw_with()), "trainer", 0)["spec"]  # one node: nothing to spread


def test_topology_spread_constraints_merge_by_topology_key():
    from rlkube.controller.manifests import podtemplate

    base = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "trainer"}], "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]}}
    tpl = parse_spec(raw_with("trainer", {"spec": {"topologySpreadConstraints": [
        {"maxSkew": 2, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"},
        {"maxSkew": 1, "topologyKey": "rack", "whenUnsatisfiable": "ScheduleAnyway"}]}})).trainer.template
    merged = podtemplate.apply(base, tpl)
    assert [(c["topologyKey"], c["maxSkew"]) for c in merged["spec"]["topologySpreadConstraints"]] == [
        ("zone", 2), ("rack", 1)]
    assert base["spec"]["topologySpreadConstraints"][0]["maxSkew"] == 1  # pure: the input is untouched


def test_the_template_round_trips_through_the_crd_schema_unpruned():
    """The CRD keeps every template field (structural; preserve-unknown only for affinity terms and volume
    sources): what the API server stores is what the operator merges."""
    from rlkube.api.crd import crd

    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    tpl = schema["properties"]["trainer"]["properties"]["template"]
    pod = tpl["properties"]["spec"]["properties"]
    assert pod["affinity"]["properties"]["nodeAffinity"]["x-kubernetes-preserve-unknown-fields"] is True
    assert pod["volumes"]["items"]["x-kubernetes-preserve-unknown-fields"] is True
    assert pod["volumes"]["items"]["required"] == ["name"]
    env = pod["containers"]["items"]["properties"]["env"]["items"]
    assert "x-kubernetes-preserve-unknown-fields" not in env and set(env["properties"]) == {"name", "value", "valueFrom"}
    for role in ROLES:
        assert schema["properties"][role]["properties"]["template"] == tpl | {
            "description": schema["properties"][role]["properties"]["template"]["description"]}


# --- every refusal, naming the field -------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "name"), [
    ("trainer", "RANK"), ("trainer", "LOCAL_RANK"), ("trainer", "WORLD_SIZE"), ("trainer", "MASTER_ADDR"),
    ("trainer", "NODE_RANK"), ("trainer", "LOCAL_WORLD_SIZE"), ("trainer", "RLKUBE_CHECKPOINT_DIR"),
    ("trainer", "REDIS_PASSWORD"), ("inference", "RLKUBE_PORT"), ("inference", "RLKUBE_WEIGHT_SYNC_ADDR"),
    ("actor", "RLKUBE_INFERENCE_URLS"), ("preprocessor", "RLKUBE_REDIS_URL"), ("actor", "RLKUBE_CONFIG"),
    ("actor", "POD_IP"), ("redis", "REDIS_PASSWORD"), ("redis", "POD_IP"),
])
def test_operator_env_is_refused(role, name):
    errs = errors_of(raw_with(role, {"spec": {"containers": [{"name": role, "env": [{"name": name, "value": "x"}]}]}}))
    assert errs == {f"spec.{role}.template.spec.containers[{role}].env[{name}]": "set by the operator"}


def test_operator_env_is_what_role_env_returns():
    """One source: the refused names are role_env's (plus the per-rank and pod-only ones)."""
    spec = parse_spec(raw_with())
    assert {"RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_PORT", "REDIS_PASSWORD", "POD_IP",
            "RLKUBE_INDEX"} <= operator_env_names(spec, "trainer")
    assert operator_env_names(spec, "redis") == {"REDIS_PASSWORD", "POD_IP"}
    for role in ("trainer", "inference", "actor", "preprocessor"):
        pod_env = {e["name"] for e in container(builders.pod(job_of(raw_with()), role, 0))["env"]}
        # The defaults a template may change: HOME, and where the model is fetched, HF_HUB_OFFLINE (the fetch's;
        # the role always runs offline).
        settable = {"HOME", "HF_HUB_OFFLINE"} if role != "preprocessor" else {"HOME"}
        assert pod_env - operator_env_names(spec, role) == settable


@pytest.mark.parametrize(("field", "value"), [
    ("command", ["sh"]), ("args", ["-c"]), ("image", "evil:1"), ("resources", {"limits": {"cpu": "1"}}),
    ("ports", []), ("readinessProbe", {}), ("livenessProbe", {}), ("startupProbe", {}), ("workingDir", "/"),
    ("envFrom", [{"secretRef": {"name": "x"}}]), ("terminationMessagePolicy", "File"),
])
def test_operator_container_fields_are_refused(field, value):
    errs = errors_of(raw_with("trainer", {"spec": {"containers": [{"name": "trainer", field: value}]}}))
    assert list(errs) == [f"spec.trainer.template.spec.containers.0.{field}"]
    assert errs[f"spec.trainer.template.spec.containers.0.{field}"].startswith("set by the operator")


@pytest.mark.parametrize(("field", "value"), [
    ("restartPolicy", "Always"), ("hostname", "x"), ("subdomain", "x"), ("terminationGracePeriodSeconds", 1),
    ("enableServiceLinks", True), ("initContainers", []),
])
def test_operator_pod_fields_are_refused(field, value):
    errs = errors_of(raw_with("actor", {"spec": {field: value}}))
    assert list(errs) == [f"spec.actor.template.spec.{field}"]


@pytest.mark.parametrize("key", ["rlkube.io/role", "rlkube.io/job-name", "rlkube.io/anything",
                                 "app.kubernetes.io/managed-by", "app.kubernetes.io/name"])
@pytest.mark.parametrize("kind", ["labels", "annotations"])
def test_operator_labels_and_annotations_are_refused(key, kind):
    errs = errors_of(raw_with("inference", {"metadata": {kind: {key: "x"}}}))
    assert list(errs) == [f"spec.inference.template.metadata.{kind}[{key}]"]


@pytest.mark.parametrize(("role", "volume"), [("trainer", "job-config"), ("trainer", "checkpoints"),
                                              ("actor", "job-config")])
def test_operator_volumes_are_refused(role, volume):
    errs = errors_of(raw_with(role, {"spec": {"volumes": [{"name": volume, "emptyDir": {}}]}}))
    assert list(errs) == [f"spec.{role}.template.spec.volumes[{volume}]"]


@pytest.mark.parametrize(("role", "path"), [("trainer", "/etc/rlkube"), ("trainer", "/checkpoints"),
                                            ("trainer", "/checkpoints/"), ("preprocessor", "/etc/rlkube")])
def test_operator_mount_paths_are_refused(role, path):
    tpl = {"spec": {"volumes": [{"name": "v", "emptyDir": {}}],
                    "containers": [{"name": role, "volumeMounts": [{"name": "v", "mountPath": path}]}]}}
    errs = errors_of(raw_with(role, tpl))
    assert list(errs) == [f"spec.{role}.template.spec.containers[{role}].volumeMounts[{path}]"]


def test_malformed_templates_are_refused_naming_the_field():
    cases = {
        "spec.actor.template.spec.containers[sidecar]": {"spec": {"containers": [{"name": "sidecar"}]}},
        "spec.actor.template.spec.containers[actor].volumeMounts[/data].name": {
            "spec": {"containers": [{"name": "actor", "volumeMounts": [{"name": "nope", "mountPath": "/data"}]}]}},
        "spec.actor.template.spec.containers[actor].env[A]": {
            "spec": {"containers": [{"name": "actor", "env": [{"name": "A"}]}]}},
        "spec.actor.template.spec.volumes[v]": {"spec": {"volumes": [{"name": "v"}]}},
    }
    for field, tpl in cases.items():
        assert list(errors_of(raw_with("actor", tpl))) == [field], field
    two_sources = {"spec": {"volumes": [{"name": "v", "emptyDir": {}, "configMap": {"name": "c"}}]}}
    assert list(errors_of(raw_with("actor", two_sources))) == ["spec.actor.template.spec.volumes[v]"]
    dup = {"spec": {"containers": [{"name": "actor", "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}]}}
    assert list(errors_of(raw_with("actor", dup))) == ["spec.actor.template.spec.containers[actor].env[A]"]
    assert "spec.actor.template.spec.tolerations.0.effect" in errors_of(
        raw_with("actor", {"spec": {"tolerations": [{"effect": "Sometimes"}]}}))
    assert "spec.actor.template.spec.volumes.0.name" in errors_of(
        raw_with("actor", {"spec": {"volumes": [{"name": "Not_A_DNS_Label", "emptyDir": {}}]}}))


def test_a_redis_template_needs_a_managed_redis():
    raw = raw_with("redis", {"spec": {"nodeSelector": {"a": "b"}}},
                   **{"redis.mode": "external", "redis.url": "redis://r:6379/0"})
    assert list(errors_of(raw)) == ["spec.redis.template"]


def test_the_gpu_count_follows_the_spec_and_processes_per_node_must_match_it():
    job = job_of(raw_with(**{"trainer.gpusPerNode": 8, "algorithm.samplesPerStep": 64,
                             "trainer.resources": {"requests": {"nvidia.com/gpu": 4}, "limits": {"nvidia.com/gpu": 4}}}))
    resources = container(builders.pod(job, "trainer", 0))["resources"]
    assert resources == {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
    # A role that gets no GPUs from the spec keeps what its resources say (a GPU preprocessor is the user's call).
    job = job_of(raw_with(**{"preprocessor.resources": {"limits": {"nvidia.com/gpu": 1}}}))
    assert container(builders.pod(job, "preprocessor", 0))["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    errs = errors_of(raw_with(**{"trainer.gpusPerNode": 2, "trainer.processesPerNode": 1}))
    assert list(errs) == ["spec.trainer.processesPerNode"]


# --- hardened by default; no Secret value anywhere; the NetworkPolicy -----------------------------------------


EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_child_of_every_example_passes_the_security_assertion(path):
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "TrainingJob")
    raw = doc["spec"]
    children = builders.all_children(job_of(raw), password="pa55-w0rd-value")
    pods = [c for c in children if c["kind"] == "Pod"]
    # A colocated engine runs in the trainer's pod (docs/guide/colocated.md): no inference pod of its own.
    engine = set() if raw.get("inference", {}).get("placement") == "colocated" else {"inference"}
    assert {p["metadata"]["labels"]["rlkube.io/role"] for p in pods} >= {"trainer", "actor"} | engine
    for pod in pods:
        assert_hardened_pod(pod, raw)
    assert_no_secret_value(children, ["pa55-w0rd-value"])


def test_a_template_relaxing_the_defaults_is_the_users_choice_and_shows():
    pod = pod_of("actor", {"spec": {"containers": [{"name": "actor", "securityContext": {
        "readOnlyRootFilesystem": False}}]}})
    with pytest.raises(AssertionError):
        assert_hardened_pod(pod, EXAMPLE)


@pytest.mark.parametrize("role", ROLES)
def test_no_role_pod_mounts_a_service_account_token_unless_its_template_asks(role):
    """No role talks to the API server: every role pod sets automountServiceAccountToken false (the namespace's
    ServiceAccount token is not mounted); a template's true is the user's choice (a process of theirs that does),
    and only that role's pods get it."""
    job = job_of(raw_with())
    assert builders.pod(job, role, 0)["spec"]["automountServiceAccountToken"] is False
    asked = job_of(raw_with(role, {"spec": {"automountServiceAccountToken": True}}))
    assert builders.pod(asked, role, 0)["spec"]["automountServiceAccountToken"] is True
    with pytest.raises(AssertionError):
        assert_hardened_pod(builders.pod(asked, role, 0), EXAMPLE)  # as the job without the template: caught
    assert_hardened_pod(builders.pod(asked, role, 0), asked.raw_spec)
    others = [r for r in ROLES if r != role]
    assert all(builders.pod(asked, r, 0)["spec"]["automountServiceAccountToken"] is False for r in others)


def test_the_network_policy_admits_exactly_the_jobs_pods_to_its_redis():
    job = job_of(raw_with())
    (policy,) = [c for c in builders.static_children(job, "pw") if c["kind"] == "NetworkPolicy"]
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    own_peer, operator_peer = rule["from"]
    assert set(own_peer) == {"podSelector"}  # no namespaceSelector: the job's own namespace only
    mine = [c for c in builders.all_children(job, "pw") if c["kind"] == "Pod"]
    # Another job's pods in the same namespace, with every override a template may add.
    other = job_of(raw_with("actor", {"metadata": {"labels": {"team": "rl"}}}), name="other")
    theirs = [c for c in builders.all_children(other, "pw") if c["kind"] == "Pod"]
    assert [p["metadata"]["name"] for p in mine if selects(spec["podSelector"], p["metadata"]["labels"])] == [
        "tj-redis"]
    assert all(selects(own_peer["podSelector"], p["metadata"]["labels"]) for p in mine)
    assert not any(selects(own_peer["podSelector"], p["metadata"]["labels"]) for p in theirs)
    assert not any(selects(spec["podSelector"], p["metadata"]["labels"]) for p in theirs)
    # The operator (it reads the trainer's events from Redis) by the chart's pod labels.
    chart_pod_labels = {"app.kubernetes.io/name": "rlkube", "app.kubernetes.io/instance": "rel",
                        "app.kubernetes.io/component": "operator", "app.kubernetes.io/part-of": "rlkube"}
    assert selects(operator_peer["podSelector"], chart_pod_labels)
    assert not any(selects(operator_peer["podSelector"], p["metadata"]["labels"]) for p in mine + theirs)
    external = job_of(raw_with(**{"redis.mode": "external", "redis.url": "redis://r:6379/0"}))
    assert not [c for c in builders.static_children(external, "pw") if c["kind"] == "NetworkPolicy"]


# --- GPUs, /dev/shm and ranks --------------------------------------------------------------------------------


def test_gpu_limits_shm_and_the_launcher():
    # a model directory: the built-in model's 2 attention heads do not split 4 ways (validation refuses it)
    job = job_of(raw_with(**{"trainer.nodes": 2, "trainer.gpusPerNode": 8, "algorithm.samplesPerStep": 64,
                             "inference.engine": "vllm", "inference.tensorParallel": 4,
                             "model.path": "/models/policy"}))
    trainer, inference, actor = (builders.pod(job, r, 1 if r == "trainer" else 0)
                                 for r in ("trainer", "inference", "actor"))
    assert container(trainer)["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container(inference)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert "nvidia.com/gpu" not in (container(actor).get("resources") or {}).get("limits", {})
    for pod in (trainer, inference):
        assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["spec"]["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(pod)["volumeMounts"]
    assert container(trainer)["command"] == ["python", "-m", "rlkube.core.launch.ranks"]
    env = {e["name"]: e.get("value") for e in container(trainer)["env"]}
    assert (env["NODE_RANK"], env["NNODES"], env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"]) == ("1", "2", "8", "16")
    # What the launcher in pod 1 gives its local rank 3: torch elastic's arithmetic.
    assert dict(rank_env(job.spec, 1, 3)) == {"RANK": "11", "LOCAL_RANK": "3", "GROUP_RANK": "1"}
    cpu = job_of(raw_with())
    assert container(builders.pod(cpu, "trainer", 0))["command"] == ["python", "-m", "rlkube.core.trainer"]
    assert "nvidia.com/gpu" not in str(builders.pod(cpu, "inference", 0))  # CPU job: no GPU anywhere


def test_every_pod_of_a_fully_overridden_job_builds_for_every_role():
    tpl = lambda role: {"metadata": {"labels": {"team": "rl"}}, "spec": {  # noqa: E731
        "nodeSelector": {"pool": "rl"}, "volumes": [{"name": "scratch", "emptyDir": {}}],
        "containers": [{"name": role, "env": [{"name": "X", "value": "1"}],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}]}}
    raw = raw_with()
    for role in ROLES:
        raw[role]["template"] = tpl(role)
    raw.setdefault("sandbox", {})["template"] = tpl("sandbox")
    job = job_of(raw)
    for role in START_ORDER:
        pod = builders.pod(job, role, 0)
        assert pod["spec"]["nodeSelector"] == {"pool": "rl"} and pod["metadata"]["labels"]["team"] == "rl"
        assert {"name": "X", "value": "1"} in container(pod)["env"]
        assert_hardened_pod(pod, raw)
