"""`python -m rlkube.core.launch.ranks`: the process of a trainer pod with several ranks (trainer.processesPerNode 2
on CPU, gloo), started with exactly the env the operator gives the pod (lifecycle.environment.role_env), against a
real Redis. Both ranks together equal single-process training on the union of each step's documents (torch and
megatron backends); SIGTERM to the launcher alone (kubelet signals only the container's first process) stops both
ranks after the same step; a rank killed with SIGKILL fails the launcher with that rank's exit code and a
termination message naming it, and the other rank is stopped."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from support.core_roles import (
    Role,
    add_documents,
    free_port,
    keys_for,
    make_documents,
    read_events,
    role_env,
    roles_fixture,  # noqa: F401  (fixture roles)
    tiny_spec,
    wait_for_event,
)
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol, runtime
from rlkube.core.trainer import Trainer
from rlkube.lifecycle import environment
from safetensors.torch import load_file

TIMEOUT = 120
GRACE = 15


def launcher_spec(backend: str = "torch", **algorithm) -> dict:
    spec = tiny_spec(**algorithm)
    spec["trainer"].update(backend=backend, processesPerNode=2)
    return spec


def start_launcher(roles: list[Role], tmp: Path, job: str, spec: dict, redis_url: str, **extra: str) -> Role:
    """One trainer 'pod': the launcher with the pod env of node 0 (here MASTER_ADDR is this machine)."""
    at = environment.Addresses(config_path="", redis_url=redis_url, bind_host="127.0.0.1", inference_urls=("",),
                               inference_ports=(0,), weight_sync_host="127.0.0.1", weight_sync_port=free_port(),
                               master_port=free_port(), checkpoint_dir=str(tmp / "ckpt"))
    pod_env = dict(environment.role_env(parse_spec(spec), "trainer", 0, at))
    assert "RANK" not in pod_env and pod_env["LOCAL_WORLD_SIZE"] == "2" and pod_env["WORLD_SIZE"] == "2"
    # No inference server here: the weight-sync address stays unset (weights are announced, not transferred).
    pod_env = {k: v for k, v in pod_env.items()
               if k not in (runtime.ENV_CONFIG, runtime.ENV_REDIS_URL, runtime.ENV_WEIGHT_SYNC,
                            runtime.ENV_INFERENCE_URLS)}
    env = role_env(tmp, job, spec, redis_url, **pod_env,
                   **{runtime.ENV_TERMINATION_LOG: str(tmp / "termination-log")}, **extra)
    process = Role(environment.LAUNCHER_MODULE, env, tmp / f"{job}-launcher.log")
    roles.append(process)
    return process


def ranks_of(launcher: Role) -> list[psutil.Process]:
    return psutil.Process(launcher.proc.pid).children()


@pytest.mark.parametrize("backend", ["torch", pytest.param("megatron", marks=pytest.mark.megatron)])
def test_two_local_ranks_equal_single_process_training(redis_client, redis_server, tmp_path, roles, backend):
    steps, per_step = 3, 8
    spec = launcher_spec(backend, maxSteps=steps, samplesPerStep=per_step)
    keys = keys_for(f"ln-{backend}", spec)
    docs = make_documents(steps * per_step, seed=5)
    add_documents(redis_client, keys, docs)
    t0 = time.monotonic()
    launcher = start_launcher(roles, tmp_path, f"ln-{backend}", spec, redis_server.url)
    assert launcher.wait(TIMEOUT) == 0, launcher.log()
    print(f"{backend}: 2 local ranks, {steps} steps: {time.monotonic() - t0:.1f}s including start-up")
    log = launcher.log()
    for rank in (0, 1):
        assert f"[rank {rank}] " in log and f"rank {rank}/2 joined the data-parallel group" in log, log[-3000:]
    consumers = {protocol.text(c["name"]) for c in redis_client.xinfo_consumers(keys.documents,
                                                                                protocol.DOCUMENTS_GROUP)}
    assert consumers == {protocol.consumer_name(0), protocol.consumer_name(1)}
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["step"] == steps and finished.payload["documents_seen"] == steps * per_step

    reference = Trainer(parse_spec(spec))
    for k in range(steps):
        reference.train_step(docs[k * per_step:(k + 1) * per_step])
    got = load_file(str(Path(finished.payload["checkpoint"]) / ckpt.MODEL_FILE))
    want = {n: t.detach() for n, t in reference.backend.state()[0].items()}
    assert got.keys() == want.keys()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    initial = Trainer(parse_spec(spec)).backend.state()[0]
    moved = max(float((want[n] - initial[n]).abs().max()) for n in want)
    print(f"{backend}: largest parameter difference to single-process training {worst:.2e} (training moved {moved:.2e})")
    assert moved > 1e-3, "training did not change the weights: the comparison would prove nothing"
    assert worst < 1e-5


def test_sigterm_to_the_launcher_alone_stops_both_ranks_after_the_same_step(redis_client, redis_server, tmp_path,
                                                                           roles):
    spec = launcher_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("lnterm", spec)
    launcher = start_launcher(roles, tmp_path, "lnterm", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))  # one step; then both ranks wait for documents
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, launcher)
    launcher.proc.send_signal(signal.SIGTERM)  # the pid only, not its process group
    assert launcher.wait(GRACE) == 0, launcher.log()
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["interrupted"] is True and finished.payload["step"] == 1
    assert "rank 0 exited 0" in launcher.log() and "rank 1 exited 0" in launcher.log()


def test_a_killed_rank_fails_the_pod_with_its_code_and_message(redis_client, redis_server, tmp_path, roles):
    spec = launcher_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("lnkill", spec)
    launcher = start_launcher(roles, tmp_path, "lnkill", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, launcher)
    children = ranks_of(launcher)
    assert len(children) == 2
    rank1 = next(p for p in children if p.environ().get("RANK") == "1")
    t0 = time.monotonic()
    rank1.kill()
    code = launcher.wait(GRACE + 10)
    print(f"launcher exited {code} {time.monotonic() - t0:.2f}s after rank 1 was killed")
    assert code == 128 + signal.SIGKILL, launcher.log()
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith(f"trainer rank 1 (node 0, local rank 1) exited {128 + signal.SIGKILL}: "), message
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children)
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)
