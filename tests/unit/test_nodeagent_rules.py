"""The node agent's pure rules, checked against kubelet's behaviour without processes or an API server:
$(VAR) expansion and env sources, pod phase and conditions, Service names in /etc/hosts, probe thresholds,
and what makes a pod unschedulable on the test node."""

from __future__ import annotations

import base64

import pytest
from nodeagent.agent import unschedulable_reason
from nodeagent.envvars import ConfigError, container_argv, container_env, expand
from nodeagent.hostsfile import hosts_file, service_records
from nodeagent.podstatus import Container, PodView, conditions, exit_code_of, phase
from nodeagent.probes import Prober


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)-$(B)", "1-two"),
        ("$$(A)", "$(A)"),  # escaped
        ("$(MISSING)", "$(MISSING)"),  # undefined: left as is
        ("$(A", "$(A"),  # unterminated
        ("cost $5 and $", "cost $5 and $"),
        ("$$$(A)", "$1"),
    ],
)
def test_expansion_follows_kubelet(text, expected):
    assert expand(text, {"A": "1", "B": "two"}) == expected


def _pod(**spec):
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "x"}},
            "spec": {"nodeName": "n1", **spec}}


def test_env_sources_order_and_references():
    data = {("secret", "s"): {"password": "pw"}, ("configmap", "c"): {"k": "v", "bad key": "x"}}
    lookup = lambda kind, ns, name: data.get((kind, name))
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "c"}, "prefix": "CM_"}],
        "env": [
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "BIND", "value": "$(IP):$(PORT)"},  # PORT is defined later: not expanded
            {"name": "PORT", "value": "80"},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}},
            {"name": "LABEL", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
        ],
        "command": ["run", "--pw=$(PW)", "$(CM_k)"],
    }
    env = container_env(_pod(), container, lookup, "10.0.0.5", "10.0.0.1", {"cpu": "2"})
    assert env == {"CM_k": "v", "IP": "10.0.0.5", "BIND": "10.0.0.5:$(PORT)", "PORT": "80", "PW": "pw",
                   "LABEL": "x", "CPU": "2"}
    assert container_argv(container, env) == ["run", "--pw=pw", "v"]


def test_missing_secret_or_key_is_a_config_error_naming_it():
    lookup = lambda kind, ns, name: {"other": "x"} if name == "s" else None
    ref = lambda name, key: {"name": "c", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}]}
    with pytest.raises(ConfigError, match='secret "gone" not found'):
        container_env(_pod(), ref("gone", "k"), lookup, None, None)
    with pytest.raises(ConfigError, match="couldn't find key password in Secret ns/s"):
        container_env(_pod(), ref("s", "password"), lookup, None, None)
    with pytest.raises(ConfigError, match="has no command"):
        container_argv({"name": "c", "args": ["x"]}, {})


def test_secret_data_is_decoded():
    from nodeagent.envvars import secret_data

    assert secret_data({"data": {"p": base64.b64encode(b"hunter2").decode()}}) == {"p": "hunter2"}


def _c(state, code=None, restarts=0, last=None, ready=False, init=False):
    return Container("c", state=state, exit_code=code, restart_count=restarts, last_terminated=last, ready=ready, init=init)


@pytest.mark.parametrize(
    ("policy", "containers", "expected"),
    [
        ("Always", [_c("waiting")], "Pending"),
        ("Always", [_c("running")], "Running"),
        ("Never", [_c("terminated", 0)], "Succeeded"),
        ("Never", [_c("terminated", 1)], "Failed"),
        ("OnFailure", [_c("terminated", 0)], "Succeeded"),
        ("OnFailure", [_c("waiting", last={"exitCode": 1})], "Running"),  # in back-off: restarting
        ("Always", [_c("terminated", 0)], "Running"),
        ("Never", [_c("terminated", 0), _c("running")], "Running"),
        ("Never", [_c("terminated", 0), _c("terminated", 2)], "Failed"),
    ],
)
def test_phase_follows_kubelet(policy, containers, expected):
    assert phase(PodView(restart_policy=policy, main=containers)) == expected


def test_init_containers_gate_the_pod():
    assert phase(PodView("Always", init=[_c("running", init=True)], main=[_c("waiting")])) == "Pending"
    assert phase(PodView("Never", init=[_c("terminated", 1, init=True)], main=[_c("waiting")])) == "Failed"
    assert phase(PodView("OnFailure", init=[_c("terminated", 1, init=True)], main=[_c("waiting")])) == "Pending"


def test_conditions_and_transition_times():
    view = PodView("Always", main=[_c("running", ready=False)])
    first = conditions(view, "Running", [], now=1000.0)
    by = {c["type"]: c for c in first}
    assert by["Ready"]["status"] == "False" and by["Ready"]["reason"] == "ContainersNotReady"
    assert by["Initialized"]["status"] == "True" and by["PodScheduled"]["status"] == "True"
    view.main[0].ready = True
    second = {c["type"]: c for c in conditions(view, "Running", first, now=2000.0)}
    assert second["Ready"]["status"] == "True" and second["Ready"]["lastTransitionTime"] != by["Ready"]["lastTransitionTime"]
    assert second["Initialized"]["lastTransitionTime"] == by["Initialized"]["lastTransitionTime"]
    done = {c["type"]: c for c in conditions(view, "Succeeded", first, now=3000.0)}
    assert done["Ready"]["reason"] == "PodCompleted"


def test_exit_codes_of_signals():
    assert exit_code_of(-9) == (137, 9) and exit_code_of(-15) == (143, 15) and exit_code_of(3) == (3, None)


def _svc(name, selector, headless=True, not_ready=False):
    return {"metadata": {"name": name, "namespace": "ns"},
            "spec": {"clusterIP": "None" if headless else "10.96.0.9", "selector": selector,
                     "publishNotReadyAddresses": not_ready}}


def _running(name, ip, ready, labels, hostname=None, subdomain=None, deleting=False):
    meta = {"name": name, "namespace": "ns", "labels": labels}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"hostname": hostname, "subdomain": subdomain},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_service_records_follow_readiness_and_deletion():
    pods = [
        _running("a-0", "10.0.0.2", True, {"app": "a"}, "a-0", "a"),
        _running("a-1", "10.0.0.3", False, {"app": "a"}, "a-1", "a"),
        _running("b-0", "10.0.0.4", False, {"app": "b"}, "b-0", "b"),
        _running("a-2", "10.0.0.5", True, {"app": "a"}, deleting=True),
    ]
    records = service_records(pods, [_svc("a", {"app": "a"}), _svc("b", {"app": "b"}, not_ready=True)])
    assert records == [
        ("ns", "a", "10.0.0.2"), ("ns", "a-0.a", "10.0.0.2"), ("ns", "b", "10.0.0.4"), ("ns", "b-0.b", "10.0.0.4"),
    ]
    own = hosts_file(records, "ns", "10.0.0.9", "me", "a")
    assert "10.0.0.9\tme.a.ns.svc.cluster.local\tme" in own
    assert "10.0.0.2\ta.ns.svc.cluster.local a.ns.svc a.ns a a-0.a.ns.svc.cluster.local a-0.a.ns.svc a-0.a.ns a-0.a" in own
    other_ns = hosts_file(records, "elsewhere")
    assert " a " not in other_ns + " " and "a.ns.svc.cluster.local" in other_ns


def test_prober_thresholds():
    p = Prober({"periodSeconds": 2, "successThreshold": 2, "failureThreshold": 2, "initialDelaySeconds": 1}, 100.0)
    assert not p.due(100.5) and p.due(101.0)
    assert not p.record(True, "", 101.0) and not p.success  # one success of two
    assert p.record(True, "", 103.0) and p.success and p.next_at == 105.0
    assert not p.record(False, "x", 105.0) and p.success  # one failure of two
    assert p.record(False, "x", 107.0) and not p.success and p.failed


def test_unschedulable_reasons():
    node = {"kubernetes.io/os": "linux"}
    gpu = {"spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}
    assert "Insufficient nvidia.com/gpu" in unschedulable_reason(gpu, node)
    assert unschedulable_reason(gpu, node, ("nvidia.com/gpu",)) is None  # a node started with --gpus
    sel = {"spec": {"nodeSelector": {"pool": "gpu"}, "containers": [{"name": "c"}]}}
    assert "node selector" in unschedulable_reason(sel, node)
    ok = {"spec": {"nodeSelector": {"kubernetes.io/os": "linux"},
                   "containers": [{"name": "c", "resources": {"requests": {"cpu": "64", "memory": "1Ti"}}}]}}
    assert unschedulable_reason(ok, node) is None  # cpu/memory are overcommitted on the test node


def test_a_status_the_api_server_did_not_take_is_sent_again(tmp_path):
    """Like kubelet's status manager: a failed status patch (timeout, 5xx) is neither lost nor fatal to the pod."""
    from types import SimpleNamespace

    from nodeagent.worker import STATUS_RETRY_S, PodWorker

    sent: list[dict] = []
    failures = [TimeoutError("read timed out")]

    def patch_status(worker, status):
        if failures:
            raise failures.pop()
        sent.append(status)

    agent = SimpleNamespace(pods_dir=tmp_path, node_ip="10.0.0.1", patch_status=patch_status,
                            write_pod_state=lambda worker: None)
    pod = {"metadata": {"namespace": "ns", "name": "p", "uid": "u1"}, "spec": {"containers": [{"name": "c"}]}}
    w = PodWorker(agent, pod)
    # Volumes ready, the container not due to start: only the status decides when the worker wakes next.
    w.volumes, w.next_start["c"] = {}, 1e9
    w._sync_status()  # the API server times out: nothing recorded as sent, a retry is due soon
    assert sent == [] and w.last_status is None and w._next_due(100.0) == pytest.approx(STATUS_RETRY_S)
    w._sync_status()
    assert len(sent) == 1 and w.last_status == sent[0] and sent[0]["phase"] == "Pending"
    assert w._next_due(100.0) == pytest.approx(5.0)
