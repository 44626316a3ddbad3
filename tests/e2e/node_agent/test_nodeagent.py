"""The test node agent runs real pods for the real kube-apiserver, and reports what really happened.

Simple pods (python one-liners, http.server) check each kubelet duty the e2e tests rely on: pod IPs and
Service names, probes that are executed, env and volumes, restart policies, and the kill sequence.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException
from nodeagent.harness import cluster_dns_argv, pod_condition, wait_for


def pod(name, containers, restart="Always", grace=5, labels=None, **spec):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {"app": name}},
        "spec": {"containers": containers, "restartPolicy": restart, "terminationGracePeriodSeconds": grace, **spec},
    }


def py(name, code, **extra):
    return {"name": name, "image": "python:3.11", "command": ["python", "-c", code], **extra}


POD_IP_ENV = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def read(core, ns, name):
    try:
        return core.read_namespaced_pod(name, ns)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def phase_is(core, ns, name, *phases):
    p = read(core, ns, name)
    return p if p and p.status.phase in phases else None


def gone(core, ns, name):
    return read(core, ns, name) is None


def test_pod_gets_its_own_ip_and_ready_comes_from_an_executed_http_probe(node_agent, core_api, namespace):
    # http.server serves the pod's working directory: /ready.txt exists only while the test says so.
    web = pod("web", [{
        "name": "web", "image": "python:3.11",
        "command": ["python", "-m", "http.server", "8080", "--bind", "$(POD_IP)"],
        "env": [POD_IP_ENV],
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/ready.txt", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1},
    }])
    core_api.create_namespaced_pod(namespace, web)
    p = wait_for(lambda: phase_is(core_api, namespace, "web", "Running"), 30, "web Running")
    ip = p.status.pod_ip
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(node_agent.info["subnet"])
    assert p.status.host_ip == node_agent.node_ip and p.spec.node_name == node_agent.node_name
    assert p.status.container_statuses[0].state.running is not None
    wait_for(lambda: pod_condition(read(core_api, namespace, "web"), "ContainersReady") == "False", 10, "not ready")
    assert pod_condition(read(core_api, namespace, "web"), "Ready") == "False"

    workdir = Path(node_agent.pod_state(namespace, "web")["dir"]) / "work"
    (workdir / "ready.txt").write_text("ok")
    wait_for(lambda: pod_condition(read(core_api, namespace, "web"), "Ready") == "True", 10, "Ready after ready.txt")
    with urllib.request.urlopen(f"http://{ip}:8080/ready.txt", timeout=5) as resp:  # the host reaches the pod IP
        assert resp.read() == b"ok"
    (workdir / "ready.txt").unlink()
    wait_for(lambda: pod_condition(read(core_api, namespace, "web"), "Ready") == "False", 10, "unready again")
    assert "GET /ready.txt" in node_agent.container_log(namespace, "web", "web")  # the probe really ran


def test_restart_policies_and_exit_codes(node_agent, core_api, namespace):
    core_api.create_namespaced_pod(namespace, pod("crash-onfailure", [py("main", "raise SystemExit(1)")], "OnFailure"))
    core_api.create_namespaced_pod(namespace, pod("crash-never", [py("main", "raise SystemExit(3)")], "Never"))
    core_api.create_namespaced_pod(namespace, pod("done-onfailure", [py("main", "print('done')")], "OnFailure"))
    core_api.create_namespaced_pod(
        namespace, pod("killed-never", [py("main", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")], "Never")
    )

    def restarted_twice():
        p = read(core_api, namespace, "crash-onfailure")
        cs = p.status.container_statuses
        return p if cs and cs[0].restart_count >= 2 and cs[0].last_state.terminated else None

    p = wait_for(restarted_twice, 30, "crash-onfailure restarted twice")
    cs = p.status.container_statuses[0]
    assert cs.last_state.terminated.exit_code == 1 and cs.last_state.terminated.reason == "Error"
    assert p.status.phase == "Running"  # OnFailure keeps restarting it: kubelet reports Running

    p = wait_for(lambda: phase_is(core_api, namespace, "crash-never", "Failed", "Succeeded"), 30, "crash-never done")
    assert p.status.phase == "Failed"
    term = p.status.container_statuses[0].state.terminated
    assert (term.exit_code, term.reason, p.status.container_statuses[0].restart_count) == (3, "Error", 0)

    p = wait_for(lambda: phase_is(core_api, namespace, "done-onfailure", "Failed", "Succeeded"), 30, "done-onfailure")
    assert p.status.phase == "Succeeded"
    assert p.status.container_statuses[0].state.terminated.reason == "Completed"
    assert pod_condition(p, "Ready") == "False"

    p = wait_for(lambda: phase_is(core_api, namespace, "killed-never", "Failed", "Succeeded"), 30, "killed-never done")
    term = p.status.container_statuses[0].state.terminated
    assert (p.status.phase, term.exit_code, term.signal) == ("Failed", 137, 9)


def test_delete_sends_sigterm_to_the_group_then_sigkill_after_the_grace_period(node_agent, core_api, namespace):
    polite = py("main", "import signal, subprocess, sys, time\n"
                "child = subprocess.Popen(['sleep', '1000'])\n"
                "def bye(*_):\n    print('got SIGTERM', flush=True); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, bye)\nprint('up', flush=True)\ntime.sleep(1000)")
    stubborn = py("main", "import signal, subprocess, time\n"
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsubprocess.Popen(['sleep', '1000'])\n"
                  "print('up', flush=True)\ntime.sleep(1000)")
    core_api.create_namespaced_pod(namespace, pod("polite", [polite], grace=3, labels={"rlkube.io/role": "actor"}))
    core_api.create_namespaced_pod(namespace, pod("stubborn", [stubborn], grace=2, labels={"rlkube.io/role": "trainer"}))
    for name in ("polite", "stubborn"):
        wait_for(lambda name=name: "up" in node_agent.container_log(namespace, name), 30, f"{name} up")
    assert len(node_agent.live_processes(namespace)) == 4  # two mains and their `sleep` children

    t0 = time.monotonic()
    core_api.delete_namespaced_pod("polite", namespace)
    wait_for(lambda: gone(core_api, namespace, "polite"), 10, "polite removed", interval=0.02)
    polite_s = time.monotonic() - t0
    t0 = time.monotonic()
    core_api.delete_namespaced_pod("stubborn", namespace)
    wait_for(lambda: gone(core_api, namespace, "stubborn"), 10, "stubborn removed", interval=0.02)
    stubborn_s = time.monotonic() - t0

    print(f"\npod removed {polite_s:.2f}s after delete (exits on SIGTERM), {stubborn_s:.2f}s (ignores it, grace 2s)")
    assert polite_s < 3.0, f"a pod that exits on SIGTERM took {polite_s:.1f}s to go: as long as its grace period"
    assert stubborn_s >= 2.0, f"a pod ignoring SIGTERM went after {stubborn_s:.1f}s, before its 2s grace period"
    assert "got SIGTERM" in node_agent.container_log(namespace, "polite")
    signals = [s for s in node_agent.signals() if s["namespace"] == namespace]
    term, kill = (next(s for s in signals if s["pod"] == "stubborn" and s["event"] == e) for e in ("SIGTERM", "SIGKILL"))
    assert 2.0 <= kill["time"] - term["time"] < 3.0
    sigs = [(s["pod"], s["event"], s["role"]) for s in signals]
    assert sigs == [
        ("polite", "deletion", "actor"), ("polite", "SIGTERM", "actor"), ("polite", "removed", "actor"),
        ("stubborn", "deletion", "trainer"), ("stubborn", "SIGTERM", "trainer"), ("stubborn", "SIGKILL", "trainer"),
        ("stubborn", "removed", "trainer"),
    ]
    assert node_agent.live_processes(namespace) == []  # the `sleep` children went with their pods


def test_env_secrets_configmaps_volumes_and_a_claim_that_outlives_its_pod(node_agent, core_api, namespace):
    core_api.create_namespaced_config_map(namespace, {
        "metadata": {"name": "settings"}, "data": {"greeting": "hello", "app.json": '{"steps": 3}'},
    })
    core_api.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    })
    report = (
        "import json, os, socket\n"
        "out = {k: os.environ.get(k) for k in ('NAME', 'NS', 'IP', 'PASSWORD', 'MSG', 'CM_greeting', 'HOSTNAME')}\n"
        "out['argv'] = os.sys.argv[1:]\n"
        "out['hostname'] = socket.gethostname()\n"
        "out['config'] = open('/etc/rlkube-e2e/config/app.json').read()\n"
        "out['secret'] = open('/etc/rlkube-e2e/secret/password').read()\n"
        "open('/rlkube-e2e/scratch/x', 'w').write('scratch')\n"
        "try:\n    open('/etc/rlkube-e2e/config/new', 'w')\n    out['readonly'] = False\n"
        "except OSError:\n    out['readonly'] = True\n"
        "open('/rlkube-e2e/data/from-writer', 'w').write('written by ' + os.environ['NAME'])\n"
        "out['hosts_has_me'] = any(os.environ['IP'] in line and socket.gethostname() in line for line in open('/etc/hosts'))\n"
        "print('REPORT ' + json.dumps(out), flush=True)\n"
    )
    writer = {
        "name": "main", "image": "python:3.11", "command": ["python", "-c", report, "$(GREETING)", "$$(GREETING)"],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}}},
            {"name": "MSG", "value": "$(GREETING) from $(NAME), $$(NAME) $(UNDEFINED)"},
        ],
        "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}],
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/rlkube-e2e/config", "readOnly": True},
            {"name": "secret", "mountPath": "/etc/rlkube-e2e/secret"},
            {"name": "scratch", "mountPath": "/rlkube-e2e/scratch"},
            {"name": "data", "mountPath": "/rlkube-e2e/data"},
        ],
    }
    volumes = [
        {"name": "config", "configMap": {"name": "settings"}},
        {"name": "secret", "secret": {"secretName": "creds"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}},
    ]
    core_api.create_namespaced_pod(namespace, pod("writer", [writer], "Never", volumes=volumes))

    # The Secret does not exist yet: the container waits with the reason, as under kubelet.
    def waiting_on_secret():
        p = read(core_api, namespace, "writer")
        cs = (p.status.container_statuses or [None])[0] if p else None
        w = cs.state.waiting if cs else None
        return w if w and w.message and "creds" in w.message else None

    w = wait_for(waiting_on_secret, 15, "writer waiting for its Secret")
    assert w.reason in ("ContainerCreating", "CreateContainerConfigError")
    core_api.create_namespaced_secret(namespace, {
        "metadata": {"name": "creds"}, "data": {"password": base64.b64encode(b"hunter2").decode()},
    })
    p = wait_for(lambda: phase_is(core_api, namespace, "writer", "Succeeded", "Failed"), 30, "writer finished")
    log = node_agent.container_log(namespace, "writer")
    assert p.status.phase == "Succeeded", log
    out = json.loads(log.split("REPORT ", 1)[1].splitlines()[0])
    assert out["NAME"] == "writer" and out["NS"] == namespace and out["IP"] == p.status.pod_ip
    assert out["PASSWORD"] == "hunter2" and out["secret"] == "hunter2"
    assert out["MSG"] == "hello from writer, $(NAME) $(UNDEFINED)"
    assert out["argv"] == ["hello", "$(GREETING)"]
    assert out["CM_greeting"] == "hello" and out["config"] == '{"steps": 3}'
    assert out["hostname"] == "writer" == out["HOSTNAME"] and out["hosts_has_me"]
    assert out["readonly"] is True
    assert not Path("/etc/rlkube-e2e/config/app.json").exists()  # the binds stayed inside the pod
    assert core_api.read_namespaced_persistent_volume_claim("data", namespace).status.phase == "Bound"

    reader = py("main", "print('READ ' + open('/rlkube-e2e/data/from-writer').read(), flush=True)",
                volumeMounts=[{"name": "data", "mountPath": "/rlkube-e2e/data"}])
    core_api.create_namespaced_pod(namespace, pod("reader", [reader], "Never", volumes=[volumes[3]]))
    p = wait_for(lambda: phase_is(core_api, namespace, "reader", "Succeeded", "Failed"), 30, "reader finished")
    assert p.status.phase == "Succeeded"
    assert "READ written by writer" in node_agent.container_log(namespace, "reader")


def test_service_names_resolve_to_ready_pods_and_follow_changes(node_agent, core_api, namespace):
    core_api.create_namespaced_service(namespace, {
        "metadata": {"name": "srv"},
        "spec": {"clusterIP": "None", "selector": {"app": "srv"}, "ports": [{"port": 7000, "targetPort": 7000}]},
    })
    server = py("main", "import os, socket\n"
                "s = socket.socket(); s.bind((os.environ['POD_IP'], 7000)); s.listen()\n"
                "while True:\n    c, _ = s.accept(); c.sendall(b'hello from ' + socket.gethostname().encode()); c.close()",
                env=[POD_IP_ENV], readinessProbe={"tcpSocket": {"port": 7000}, "periodSeconds": 1})
    core_api.create_namespaced_pod(namespace, pod("srv-0", [server], hostname="srv-0", subdomain="srv",
                                                  labels={"app": "srv"}))
    client_code = (
        "import json, socket, time\n"
        f"ns = {namespace!r}\n"
        "names = ['srv', f'srv.{ns}', f'srv.{ns}.svc.cluster.local', 'srv-0.srv', f'srv-0.srv.{ns}.svc.cluster.local']\n"
        "out = {}\n"
        "for n in names:\n    out[n] = socket.gethostbyname(n)\n"
        "with socket.create_connection(('srv-0.srv', 7000), timeout=5) as c:\n    out['reply'] = c.recv(100).decode()\n"
        "deadline = time.time() + 30\n"
        "while True:\n"
        "    try:\n        out['late'] = socket.gethostbyname('late'); break\n"
        "    except OSError:\n"
        "        if time.time() > deadline: raise\n        time.sleep(0.1)\n"
        "print('REPORT ' + json.dumps(out), flush=True)\n"
    )
    wait_for(lambda: pod_condition(read(core_api, namespace, "srv-0"), "Ready") == "True", 30, "srv-0 Ready")
    srv_ip = read(core_api, namespace, "srv-0").status.pod_ip
    core_api.create_namespaced_pod(namespace, pod("client", [py("main", client_code)], "Never", labels={"app": "late"}))
    wait_for(lambda: "srv-0" in node_agent.container_log(namespace, "client") or
             phase_is(core_api, namespace, "client", "Running", "Failed"), 30, "client started")
    # The client is already running when this Service appears: its /etc/hosts must change in place.
    core_api.create_namespaced_service(namespace, {
        "metadata": {"name": "late"},
        "spec": {"clusterIP": "None", "selector": {"app": "late"}, "ports": [{"port": 1, "targetPort": 1}]},
    })
    p = wait_for(lambda: phase_is(core_api, namespace, "client", "Succeeded", "Failed"), 60, "client finished")
    log = node_agent.container_log(namespace, "client")
    assert p.status.phase == "Succeeded", log
    out = json.loads(log.split("REPORT ", 1)[1].splitlines()[0])
    assert {out[n] for n in out if n.startswith("srv")} == {srv_ip}
    assert out["reply"] == "hello from srv-0"
    assert out["late"] == p.status.pod_ip
    # A process on the host resolves the same names through the agent's host view of /etc/hosts.
    argv = cluster_dns_argv(node_agent.state_dir / "hosts", ["getent", "hosts", f"srv-0.srv.{namespace}.svc"])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout
    assert out.split()[0] == srv_ip


def test_exec_probes_run_inside_the_pod_and_liveness_restarts(node_agent, core_api, namespace):
    code = ("import os, time\n"
            "d = '/rlkube-e2e/state'\n"
            "if os.path.exists(f'{d}/dead'):\n    os.remove(f'{d}/dead'); print('second life', flush=True)\n"
            "else:\n    time.sleep(1); open(f'{d}/ready', 'w').close(); time.sleep(2); open(f'{d}/dead', 'w').close()\n"
            "time.sleep(1000)")
    c = py("main", code, volumeMounts=[{"name": "state", "mountPath": "/rlkube-e2e/state"}],
           readinessProbe={"exec": {"command": ["cat", "/rlkube-e2e/state/ready"]}, "periodSeconds": 1},
           livenessProbe={"exec": {"command": ["test", "!", "-e", "/rlkube-e2e/state/dead"]}, "periodSeconds": 1,
                          "initialDelaySeconds": 1, "failureThreshold": 1})
    core_api.create_namespaced_pod(namespace, pod("probed", [c], grace=1, volumes=[{"name": "state", "emptyDir": {}}]))
    wait_for(lambda: pod_condition(read(core_api, namespace, "probed"), "Ready") == "True", 30, "probed Ready")

    def restarted():
        p = read(core_api, namespace, "probed")
        return p if p.status.container_statuses[0].restart_count == 1 else None

    p = wait_for(restarted, 30, "liveness restart")
    assert p.status.container_statuses[0].last_state.terminated.exit_code == 143  # 128 + SIGTERM
    wait_for(lambda: "second life" in node_agent.container_log(namespace, "probed"), 15, "second life")
    reasons = [s["reason"] for s in node_agent.signals() if s["namespace"] == namespace and s["event"] == "SIGTERM"]
    assert reasons == ["liveness probe failed"]


def test_init_containers_isolated_ports_and_unschedulable_pods(node_agent, core_api, namespace):
    init = py("init", "open('/rlkube-e2e/init/msg', 'w').write('from init')",
              volumeMounts=[{"name": "w", "mountPath": "/rlkube-e2e/init"}])
    main = py("main", "print('MAIN ' + open('/rlkube-e2e/init/msg').read(), flush=True)",
              volumeMounts=[{"name": "w", "mountPath": "/rlkube-e2e/init"}])
    core_api.create_namespaced_pod(namespace, pod("with-init", [main], "Never", initContainers=[init],
                                                  volumes=[{"name": "w", "emptyDir": {}}]))
    # Two pods listening on 0.0.0.0:29500 at once: each has its own network namespace.
    listen = py("main", "import socket, time\ns = socket.socket(); s.bind(('0.0.0.0', 29500)); s.listen()\ntime.sleep(1000)",
                readinessProbe={"tcpSocket": {"port": 29500}, "periodSeconds": 1})
    for name in ("store-a", "store-b"):
        core_api.create_namespaced_pod(namespace, pod(name, [listen], grace=1))
    gpu = py("main", "print(1)", resources={"limits": {"nvidia.com/gpu": "1"}})
    core_api.create_namespaced_pod(namespace, pod("wants-gpu", [gpu]))

    p = wait_for(lambda: phase_is(core_api, namespace, "with-init", "Succeeded", "Failed"), 30, "with-init done")
    assert p.status.phase == "Succeeded"
    assert p.status.init_container_statuses[0].state.terminated.exit_code == 0
    assert "MAIN from init" in node_agent.container_log(namespace, "with-init", "main")
    for name in ("store-a", "store-b"):
        wait_for(lambda name=name: pod_condition(read(core_api, namespace, name), "Ready") == "True", 30, f"{name} Ready")

    def unschedulable():
        p = read(core_api, namespace, "wants-gpu")
        for c in p.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False":
                return c
        return None

    cond = wait_for(unschedulable, 15, "wants-gpu Unschedulable")
    assert cond.reason == "Unschedulable" and "nvidia.com/gpu" in cond.message
    assert read(core_api, namespace, "wants-gpu").spec.node_name is None


@pytest.fixture(autouse=True)
def _no_leftovers(node_agent, namespace, core_api):
    """Every test ends with its pods deleted through the agent and none of their processes alive."""
    yield
    # One by one: kube-apiserver 1.20's deletecollection reuses one DeleteOptions for every pod, so a
    # finished pod (grace forced to 0) makes the next ones force-deleted too.
    for p in core_api.list_namespaced_pod(namespace).items:
        core_api.delete_namespaced_pod(p.metadata.name, namespace, grace_period_seconds=1)
    wait_for(lambda: not core_api.list_namespaced_pod(namespace).items, 30, "pods removed")
    left = [(p.pid, p.cmdline()) for p in node_agent.live_processes(namespace)]
    assert left == []
