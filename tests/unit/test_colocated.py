"""Colocated placement (spec.inference.placement `colocated`, docs/guide/colocated.md): what validation refuses (the
webhook, `rlkube validate` and the operator alike), what the builders make of it (one trainer pod running both
processes, Ready when its engine is), the actors' gate, the engine's environment, and the supervisor's verdict
(rlkube.core.launch.colocated) when either process fails."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import UTC, datetime

import pytest
from support import specs
import yaml
from rlkube.api.role import Role
from rlkube.contract import runtime
from rlkube.controller.manifests import builders
from rlkube.controller.process import admission
from rlkube.controller.decisions.actions import Create
from rlkube.api.status import TrainingJobStatus
from rlkube.controller.decisions.recipe import JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed, PodView
from rlkube.core.launch import colocated as supervisor
from rlkube.lifecycle import roles
from rlkube.lifecycle.environment import COLOCATED_MODULE, role_module
from rlkube.lifecycle.validation import SpecError, parse_spec
from support.waiting import wait_for

pytestmark = pytest.mark.unit

COLOCATED = {"inference.placement": "colocated", "inference.engine": "native"}
FIELD = "spec.inference.placement"
T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def _errors(**overrides) -> str:
    with pytest.raises(SpecError) as info:
        parse_spec(specs.spec(**{**COLOCATED, **overrides}))
    return str(info.value)


@pytest.mark.parametrize(("overrides", "says"), [
    ({"inference.engine": "vllm"}, "engine vllm is not colocated"),
    ({"inference.replicas": 2}, "spec.inference.replicas is 2"),
    ({"trainer.nodes": 2}, "one trainer process"),
    ({"trainer.processesPerNode": 2, "algorithm.samplesPerStep": 32}, "one trainer process"),
])
def test_what_cannot_be_colocated_is_refused_naming_the_field(overrides, says):
    message = _errors(**overrides)
    assert f"{FIELD}: " in message and says in message


def test_a_vllm_colocation_is_refused_by_the_webhook_rlkube_validate_and_the_operator(tmp_path):
    doc = specs.document(**{f"spec.{k}": v for k, v in {**COLOCATED, "inference.engine": "vllm"}.items()})
    review = admission.review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "operation": "CREATE", "namespace": "ns", "object": doc}})["response"]
    assert review["allowed"] is False and f"{FIELD}: colocated runs the native engine" in review["status"]["message"]

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    cli = subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(path)], capture_output=True, text=True)
    assert cli.returncode != 0 and f"{FIELD}: colocated runs the native engine" in cli.stdout + cli.stderr

    raw = doc["spec"]
    try:
        spec, error = parse_spec(raw), None
    except SpecError as exc:
        spec, error = None, str(exc)
    d = decide(JobView("ns", "j", "uid-j", 1, raw, spec, error, False, TrainingJobStatus()),
               Observed(event_source=EventSource("Reachable", "Connected", "redis://x", caught_up=True)), T0)
    failed = next(c for c in d.status.conditions if c.type == "Failed")
    assert (failed.status, failed.reason) == ("True", "InvalidSpec") and FIELD in failed.message
    assert not [a for a in d.actions if isinstance(a, Create)]


def _job(**overrides) -> builders.JobRef:
    raw = specs.spec(**{**COLOCATED, **overrides})
    return builders.JobRef("ns", "j", "uid-j", parse_spec(raw), raw)


def test_one_trainer_pod_runs_both_and_is_ready_when_its_engine_is():
    job = _job()
    children = builders.all_children(job)
    pods = {c["metadata"]["name"]: c for c in children if c["kind"] == "Pod"}
    assert sorted(pods) == ["j-actor-0", "j-preprocessor-0", "j-redis", "j-trainer-0"]
    services = [c["metadata"]["name"] for c in children if c["kind"] == "Service"]
    assert "j-inference" not in services and "j-trainer" in services
    [trainer] = pods["j-trainer-0"]["spec"]["containers"]
    assert trainer["command"] == ["python", "-m", COLOCATED_MODULE]
    assert trainer["readinessProbe"]["httpGet"] == {"path": "/health", "port": runtime.INFERENCE_PORT}
    assert {"name": "http", "containerPort": runtime.INFERENCE_PORT, "protocol": "TCP"} in trainer["ports"]
    trainer_service = next(c for c in children if c["metadata"]["name"] == "j-trainer" and c["kind"] == "Service")
    assert runtime.INFERENCE_PORT in [p["port"] for p in trainer_service["spec"]["ports"]]
    url = f"http://j-trainer-0.j-trainer:{runtime.INFERENCE_PORT}"
    [actor] = pods["j-actor-0"]["spec"]["containers"]
    assert {"name": runtime.ENV_INFERENCE_URLS, "value": url} in actor["env"]

    # The engine's environment is an inference role's: its port and index, bound to the pod IP, no trainer rank.
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    engine = supervisor.engine_env({k: v for k, v in env.items() if v is not None})
    assert engine[runtime.ENV_PORT] == str(runtime.INFERENCE_PORT) and engine[runtime.ENV_BIND_HOST] == "$(POD_IP)"
    assert engine[runtime.ENV_WEIGHT_SYNC] == env[runtime.ENV_WEIGHT_SYNC]
    for gone in ("RANK", "WORLD_SIZE", runtime.ENV_CHECKPOINT_DIR, runtime.ENV_COLOCATED_ENGINE,
                 runtime.ENV_INFERENCE_URLS):
        assert gone not in engine
    assert env[runtime.ENV_PORT] == str(runtime.WEIGHT_SYNC_PORT)  # the trainer keeps its own


def test_a_separate_job_is_unchanged():
    spec = parse_spec(specs.spec())
    assert roles.replicas(spec, Role.INFERENCE) == 1 and role_module(spec, Role.TRAINER) == "rlkube.core.trainer"


def test_the_actors_wait_for_the_colocated_trainer_to_be_ready():
    spec = _job().spec
    assert roles.replicas(spec, Role.INFERENCE) == 0
    exist = {Role.REDIS: 1, Role.TRAINER: 1, Role.INFERENCE: 0, Role.SANDBOX: 0, Role.PREPROCESSOR: 1}
    waiting = roles.StartState(exist, {Role.REDIS: 1, Role.TRAINER: 0})
    assert not roles.may_start(spec, Role.ACTOR, waiting)
    assert roles.may_start(spec, Role.ACTOR, roles.StartState(exist, {Role.REDIS: 1, Role.TRAINER: 1}))


def _pod(role: str, ready: bool) -> PodView:
    name = "j-redis" if role == "redis" else f"j-{role}-0"
    return PodView(name=name, role=role, index=0, phase="Running", ready=ready, uid=f"uid-{name}",
                   started_at=T0, pod_ip="10.0.0.9")


def test_the_operator_creates_the_actors_once_the_trainer_pod_is_ready():
    job = _job()
    view = JobView("ns", "j", "uid-j", 1, job.raw_spec, job.spec, None, False, TrainingJobStatus())
    static = frozenset({"ConfigMap/j-config", "Secret/j-redis", "NetworkPolicy/j-redis", "Service/j-redis",
                        "Service/j-trainer"})

    def created(trainer_ready: bool) -> list[str]:
        obs = Observed(pods=(_pod("redis", True), _pod("trainer", trainer_ready), _pod("preprocessor", True)),
                       event_source=EventSource("Reachable", "Connected", "redis://x", caught_up=True),
                       static_present=static)
        return [a.name for a in decide(view, obs, T0).actions if isinstance(a, Create)]

    assert created(trainer_ready=False) == []
    assert created(trainer_ready=True) == ["j-actor-0"]


def _stub(code: int, message: str = "", wait: bool = False) -> str:
    """A child that writes its termination message and exits `code` (after SIGTERM when `wait`)."""
    body = (f"import os, signal, sys, time\n"
            f"open(os.environ['{runtime.ENV_TERMINATION_LOG}'], 'w').write({message!r})\n")
    if wait:
        body += "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\ntime.sleep(60)\n"
    return body + f"sys.exit({code})\n"


def _supervise(tmp_path, monkeypatch, trainer: str, engine: str) -> tuple[int, str]:
    log = tmp_path / "pod.termination-log"
    log.unlink(missing_ok=True)
    monkeypatch.setenv(runtime.ENV_TERMINATION_LOG, str(log))  # where the pod's message goes (this process's env)
    env = {"PATH": "/usr/bin:/bin", runtime.ENV_TERMINATION_LOG: str(log),
           runtime.ENV_COLOCATED_ENGINE: json.dumps({"env": {"ROLE": "engine"}, "unset": []})}
    code = supervisor.run(env, argv={supervisor.TRAINER: [sys.executable, "-c", trainer],
                                     supervisor.ENGINE: [sys.executable, "-c", engine]})
    return code, log.read_text() if log.exists() else ""


def test_the_pod_says_which_process_failed(tmp_path, monkeypatch):
    code, message = _supervise(tmp_path, monkeypatch, _stub(0, wait=True), _stub(runtime.EXIT_CONFIG, "spec.model.path: no"))
    assert code == runtime.EXIT_CONFIG
    assert message == (f"the inference engine (colocated with the trainer) exited {runtime.EXIT_CONFIG}: "
                       "spec.model.path: no")
    code, message = _supervise(tmp_path, monkeypatch, _stub(3, "out of documents"), _stub(0, wait=True))
    assert (code, message) == (3, "the trainer exited 3: out of documents")


def test_the_trainer_finishing_stops_the_engine_and_succeeds(tmp_path, monkeypatch):
    code, message = _supervise(tmp_path, monkeypatch, _stub(0), _stub(0, wait=True))
    assert (code, message) == (0, "")
    # An engine that leaves before its trainer finished is a failure, whatever its exit code.
    code, message = _supervise(tmp_path, monkeypatch, _stub(0, wait=True), _stub(0, "left"))
    assert (code, message) == (1, "the inference engine (colocated with the trainer) exited 1: left")


def test_sigterm_reaches_both_and_the_trainers_exit_is_the_pods(tmp_path):
    """kubelet signals only the container's first process: the supervisor passes SIGTERM on to both."""
    marks = {role: tmp_path / role for role in ("trainer", "engine")}

    def child(role: str, code: int) -> str:
        return (f"import pathlib, signal, sys, time\n"
                f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(marks[role])!r}).write_text('term'), "
                f"sys.exit({code})))\npathlib.Path({str(marks[role])!r}).write_text('up')\ntime.sleep(60)\n")

    script = ("import sys\nfrom rlkube.core.launch import colocated\n"
              f"sys.exit(colocated.run(argv={{'trainer': [sys.executable, '-c', {child('trainer', 0)!r}], "
              f"'inference': [sys.executable, '-c', {child('engine', 5)!r}]}}))\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path),
           runtime.ENV_TERMINATION_LOG: str(tmp_path / "pod.termination-log"),
           runtime.ENV_COLOCATED_ENGINE: json.dumps({"env": {}, "unset": []})}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    wait_for(lambda: all(m.exists() for m in marks.values()), 30, "both children started")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0  # the trainer's code; the engine stopping on the signal is no failure
    assert {r: m.read_text() for r, m in marks.items()} == {"trainer": "term", "engine": "term"}
    assert not (tmp_path / "pod.termination-log").exists()
