"""spec.sandbox.mode `pods`: the builders' sandbox pods, Service and NetworkPolicy, the actors' sandbox URLs, the
start gate (actors wait for every sandbox pod), the teardown order (right after the actors), a dead sandbox pod
recreated, the validation of the pool, and the chart's optional RuntimeClass."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from support import specs
from support.helm_chart import find, render
from support.pod_security import SANDBOX_UID, assert_hardened_pod, assert_sandbox_pod
from rlkube.api.status import TrainingJobStatus
from rlkube.contract import runtime
from rlkube.controller.manifests import builders
from rlkube.controller.decisions.actions import Create
from rlkube.controller.decisions.recipe import JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed, PodView
from rlkube.lifecycle import roles
from rlkube.lifecycle.validation import SpecError, parse_spec

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
REACHABLE = EventSource("Reachable", "Connected", "redis://10.0.0.9:6379/0", caught_up=True)
POOL = {"task.environment": {"name": "calculator"}, "sandbox": {"mode": "pods", "replicas": 2}}
STATIC = frozenset({"ConfigMap/j-config", "Secret/j-redis", "NetworkPolicy/j-redis", "NetworkPolicy/j-sandbox",
                    "Service/j-redis", "Service/j-inference", "Service/j-trainer", "Service/j-sandbox"})


def raw(**overrides) -> dict:
    return specs.spec(**{**POOL, **overrides})


def ref(raw_spec: dict) -> builders.JobRef:
    return builders.JobRef("ns", "j", "uid-j", parse_spec(raw_spec), raw_spec)


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0].get("env", [])}


def test_sandbox_pods_are_hardened_hold_no_secret_and_the_actors_get_their_urls():
    r = raw()
    job = ref(r)
    kinds = [(c["kind"], c["metadata"]["name"]) for c in builders.all_children(job)]
    assert ("NetworkPolicy", "j-sandbox") in kinds and ("Service", "j-sandbox") in kinds
    assert [n for k, n in kinds if k == "Pod" and "sandbox" in n] == ["j-sandbox-0", "j-sandbox-1"]
    pod = builders.pod(job, "sandbox", 1)
    assert_hardened_pod(pod, r)
    assert_sandbox_pod(pod, r)
    spec = pod["spec"]
    assert spec["runtimeClassName"] == "gvisor" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsUser"] == SANDBOX_UID != builders.RUN_AS
    assert spec["hostname"] == "j-sandbox-1" and spec["subdomain"] == "j-sandbox"
    assert spec["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}]
    env = env_of(pod)
    assert json.loads(env[runtime.ENV_SANDBOX_LIMITS]) == {"timeout_s": 5.0, "cpu_s": 5, "memory_mb": 512,
                                                            "output_bytes": 65536, "processes": 64}
    assert env[runtime.ENV_SANDBOX_REQUIRE_NETNS] == "1" and env[runtime.ENV_SANDBOX_WORK] == "/tmp"
    assert not [k for k in env if "REDIS" in k or k == runtime.ENV_CONFIG]
    assert env_of(builders.pod(job, "actor", 0))[runtime.ENV_SANDBOX_URLS] == (
        "http://j-sandbox-0.j-sandbox:8090,http://j-sandbox-1.j-sandbox:8090")


def test_the_network_policy_admits_the_actors_only_and_lets_nothing_out():
    policy = builders.sandbox_network_policy(ref(raw()))
    spec = policy["spec"]
    assert spec["podSelector"]["matchLabels"] == {"rlkube.io/job-name": "j", "rlkube.io/role": "sandbox"}
    assert spec["policyTypes"] == ["Ingress", "Egress"] and spec["egress"] == []
    assert spec["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"rlkube.io/job-name": "j",
                                                                          "rlkube.io/role": "actor"}}}],
                                "ports": [{"protocol": "TCP", "port": 8090}]}]


def test_process_mode_builds_no_sandbox_and_the_actor_runs_snippets_itself():
    job = ref(raw(sandbox={"mode": "process"}))
    assert roles.replicas(job.spec, "sandbox") == 0
    assert not [c for c in builders.all_children(job) if "sandbox" in c["metadata"]["name"]]
    assert runtime.ENV_SANDBOX_URLS not in env_of(builders.pod(job, "actor", 0))


def test_a_runtime_class_name_of_null_leaves_the_cluster_default_and_a_template_can_set_one():
    assert "runtimeClassName" not in builders.pod(ref(raw(**{"sandbox.runtimeClassName": None})), "sandbox", 0)["spec"]
    tpl = {"spec": {"runtimeClassName": "kata"}}
    assert builders.pod(ref(raw(**{"sandbox.template": tpl})), "sandbox", 0)["spec"]["runtimeClassName"] == "kata"


@pytest.mark.parametrize("overrides, field", [
    ({"task.environment": None}, "spec.sandbox.mode"),
    ({"sandbox.resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}, "spec.sandbox.resources.limits"),
    ({"sandbox.replicas": 0}, "spec.sandbox.replicas"),
    ({"sandbox.mode": "vm"}, "spec.sandbox.mode"),
])
def test_a_pool_that_cannot_work_is_refused_naming_the_field(overrides, field):
    r = specs.spec(**POOL)
    r = specs.with_overrides(r, {k: v for k, v in overrides.items() if v is not None})
    for k, v in overrides.items():
        if v is None:
            r = specs.with_overrides(r, {k: specs.DELETE})
    with pytest.raises(SpecError) as err:
        parse_spec(r)
    assert field in str(err.value), str(err.value)


@pytest.mark.parametrize("template, field", [
    ({"spec": {"containers": [{"name": "sandbox", "env": [{"name": runtime.ENV_SANDBOX_LIMITS, "value": "{}"}]}]}},
     f"spec.sandbox.template.spec.containers[sandbox].env[{runtime.ENV_SANDBOX_LIMITS}]"),
    ({"spec": {"containers": [{"name": "helper"}]}}, "spec.sandbox.template.spec.containers[helper]"),
    ({"metadata": {"labels": {"rlkube.io/role": "actor"}}}, "spec.sandbox.template.metadata.labels[rlkube.io/role]"),
    ({"spec": {"volumes": [{"name": "tmp", "emptyDir": {}}]}}, "spec.sandbox.template.spec.volumes[tmp]"),
])
def test_a_sandbox_template_that_takes_what_the_operator_sets_is_refused_naming_the_field(template, field):
    with pytest.raises(SpecError) as err:
        parse_spec(raw(**{"sandbox.template": template}))
    assert field in str(err.value), str(err.value)


def test_a_sandbox_template_may_add_its_own_env_and_the_operator_builds_it():
    tpl = {"spec": {"containers": [{"name": "sandbox", "env": [{"name": runtime.ENV_SANDBOX_LAYERS,
                                                                  "value": "netns"}]}]}}
    pod = builders.sandbox_pod(ref(raw(**{"sandbox.template": tpl})), 0)
    assert env_of(pod)[runtime.ENV_SANDBOX_LAYERS] == "netns"


# -- the operator's decisions ------------------------------------------------------------------------------


def view(status: TrainingJobStatus | None = None) -> JobView:
    r = raw()
    return JobView("ns", "j", "uid-j", 1, r, parse_spec(r), None, False, status or TrainingJobStatus())


def pod(role: str, index: int = 0, phase: str = "Running", ready: bool = True) -> PodView:
    name = "j-redis" if role == "redis" else f"j-{role}-{index}"
    return PodView(name=name, uid=f"uid-{name}", role=role, index=index, phase=phase, ready=ready,
                   started_at=T0 - timedelta(minutes=5), pod_ip="10.0.0.9")


def run(j: JobView, pods, now=T0):
    obs = Observed(pods=tuple(pods), events=(), read_upto=None, event_source=REACHABLE, events_read_to_end=True,
                   static_present=STATIC)
    return decide(j, obs, now)


def creates(d) -> list[str]:
    return [a.name for a in d.actions if isinstance(a, Create)]


def test_sandbox_pods_start_with_the_trainer_and_the_actors_wait_for_them_ready():
    first = run(view(), [])
    assert creates(first) == ["j-redis", "j-sandbox-0", "j-sandbox-1"]  # they need nothing of the job
    d = run(view(TrainingJobStatus(phase="Starting")), [pod("redis")])
    assert creates(d) == ["j-trainer-0", "j-inference-0", "j-sandbox-0", "j-sandbox-1", "j-preprocessor-0"]
    up = [pod("redis"), pod("trainer"), pod("inference"), pod("preprocessor"), pod("sandbox"),
          pod("sandbox", 1, ready=False)]
    d = run(view(TrainingJobStatus(phase="Starting")), up)
    assert creates(d) == [] and d.status.components["sandbox"].ready == 1
    up[-1] = pod("sandbox", 1)
    d = run(view(TrainingJobStatus(phase="Starting")), up)
    assert creates(d) == ["j-actor-0"]


def test_a_job_running_before_its_sandbox_pods_are_ready_still_holds_its_actors_back():
    # The trainer reports (its first event) before the sandbox pods are ready: the job turns Running, and the
    # actors, none of which exists yet, still start only through their gate.
    from rlkube.api.status import TrainerStatus

    running = TrainingJobStatus(phase="Running", trainer=TrainerStatus(last_event_id="1-0"))
    up = [pod("redis"), pod("trainer"), pod("inference"), pod("preprocessor"), pod("sandbox", ready=False),
          pod("sandbox", 1, ready=False)]
    d = run(view(running), up)
    assert d.status.phase == "Running" and creates(d) == []
    d = run(view(d.status), [*up[:4], pod("sandbox"), pod("sandbox", 1)], now=T0 + timedelta(seconds=5))
    assert creates(d) == ["j-actor-0"]


def test_a_sandbox_pod_that_is_gone_while_running_is_recreated_and_one_that_failed_is_replaced():
    everything = [pod("redis"), pod("trainer"), pod("inference"), pod("preprocessor"), pod("sandbox"),
                  pod("sandbox", 1), pod("actor")]
    d = run(view(TrainingJobStatus(phase="Starting")), everything)
    assert d.status.phase == "Running"
    d = run(view(d.status), [p for p in everything if p.name != "j-sandbox-1"], now=T0 + timedelta(seconds=5))
    assert creates(d) == ["j-sandbox-1"]
    failed = [p if p.name != "j-sandbox-0" else pod("sandbox", 0, phase="Failed", ready=False) for p in everything]
    d = run(view(d.status), failed, now=T0 + timedelta(seconds=10))
    assert ("j-sandbox-0", "uid-j-sandbox-0") in [(a.name, getattr(a, "uid", None)) for a in d.actions]
    assert d.status.components["sandbox"].restarts == 1 and d.status.phase == "Running"


def test_teardown_stops_the_sandbox_pods_with_the_actors_each_with_its_own_grace():
    from datetime import UTC, datetime

    from rlkube.api.spec import GracePeriods
    from rlkube.api.status import TeardownStatus
    from rlkube.controller.decisions import teardown
    from rlkube.controller.decisions.observed import PodView

    assert roles.TEARDOWN_ORDER[0] == "actor" and "sandbox" not in roles.TEARDOWN_ORDER
    assert roles.TEARDOWN_ORDER[-1] == "redis"
    pods = [PodView(name=f"j-{r}-0", uid=r, role=r, index=0) for r in ("redis", "trainer", "sandbox", "actor")]
    step = teardown.advance(TeardownStatus(reason="Deleted"), pods, GracePeriods(actor=10, sandbox=3), False,
                            datetime(2025, 1, 1, tzinfo=UTC))
    assert step.status.stage == "actor"
    assert sorted((a.name, a.grace_seconds) for a in step.actions) == [("j-actor-0", 10), ("j-sandbox-0", 3)]


def test_the_chart_installs_a_gvisor_runtime_class_only_when_asked():
    assert not find(render(), "RuntimeClass")
    rc = find(render({"sandbox": {"runtimeClass": {"create": True}}}), "RuntimeClass")
    assert [(r["metadata"]["name"], r["handler"]) for r in rc] == [("gvisor", "runsc")]
