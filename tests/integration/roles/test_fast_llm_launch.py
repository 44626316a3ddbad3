"""The Fast-LLM trainer pod's launcher (rlkube.core.launch.fast_llm) against a real password-protected redis-server
and a real torchrun, with a stand-in for `fast-llm train gpt` that makes Fast-LLM's Redis and torch.distributed
calls (fast_llm_stand_in.py; Fast-LLM itself needs Python 3.12 and CUDA).

Covered: Fast-LLM's password-less Redis client works through the relay (and is refused without it); a wrong
password reaches no Redis; under the pod's torchrun command (static rendezvous) Fast-LLM's broadcast rendezvous
finds the store the launcher hosts and an inference-side peer receives the weights, and without that store it
cannot rendezvous (what PipelineRL works around); the launcher announces its store's generation, which the
receiver reads from the store it joined through; the Secret never reaches Fast-LLM's environment; exit status and
SIGTERM pass through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import torch
import yaml
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import fastllm
from rlkube.core.launch import fast_llm as fast_llm_launch
from rlkube.core.weights.fast_llm import FastLlmReceiver
from rlkube.local.ports import free_port
from rlkube.local.redis_server import RedisServer
from support import DIR as SUPPORT, ROOT

STAND_IN = SUPPORT / "fast_llm_stand_in.py"
PASSWORD = "pw-for-the-relay-test"


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD).start()
    yield server
    server.stop()


@pytest.fixture
def admin(secured_redis):
    client = secured_redis.client()
    client.flushall()
    yield client
    client.close()


def test_fast_llms_client_needs_the_relay_and_works_through_it(secured_redis, admin):
    # Fast-LLM's client, as RedisConfig.get_client builds it: host and port, nothing else.
    direct = redis.Redis("127.0.0.1", secured_redis.port)
    with pytest.raises(redis.exceptions.AuthenticationError):
        direct.xadd("fast_llm_events", {"event": "{}"})
    relay = fast_llm_launch.RedisAuthRelay(("127.0.0.1", 0), ("127.0.0.1", secured_redis.port), PASSWORD).start()
    try:
        client = redis.Redis(*relay.address)
        client.xgroup_create(name="fast_llm_streaming", groupname="fast_llm_group", id="0", mkstream=True)
        admin.xadd("fast_llm_streaming", {"tokens": torch.arange(4, dtype=torch.int64).numpy().tobytes()})
        got = client.xreadgroup(groupname="fast_llm_group", consumername="fast_llm_consumer_0",
                                streams={"fast_llm_streaming": ">"}, count=1, block=1000, noack=True)
        (_, [(_, fields)]), = got
        assert torch.frombuffer(bytearray(fields[b"tokens"]), dtype=torch.int64).tolist() == [0, 1, 2, 3]
        # A blocking read with nothing to read returns empty after its block time, as for Fast-LLM's 1 s polls.
        start = time.monotonic()
        assert client.xreadgroup("fast_llm_group", "fast_llm_consumer_0", {"fast_llm_streaming": ">"},
                                 count=1, block=300, noack=True) == []
        assert time.monotonic() - start >= 0.25
        client.xadd("fast_llm_events", {"event": json.dumps({"type": "training_finished"})})
        assert admin.xlen("fast_llm_events") == 1
        # Several clients at once (one per data loader and the events client), each its own upstream connection.
        others = [redis.Redis(*relay.address) for _ in range(4)]
        assert [c.ping() for c in others] == [True] * 4
        clients = [c for c in admin.client_list() if c["cmd"] != "client|list"]
        assert len(clients) >= 5
        for c in [client, *others]:
            c.close()
    finally:
        relay.close()


def test_a_wrong_password_reaches_no_redis(secured_redis, caplog):
    relay = fast_llm_launch.RedisAuthRelay(("127.0.0.1", 0), ("127.0.0.1", secured_redis.port), "wrong").start()
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(*relay.address, socket_timeout=5).ping()
    finally:
        relay.close()
    assert any("refused AUTH" in r.getMessage() for r in caplog.records)
    assert not any("wrong" in r.getMessage() for r in caplog.records)


def _pod_command(tmp_path: Path, redis_port: int, store: bool, rendezvous_timeout_s: float) -> tuple[list[str], dict]:
    """The trainer pod 0 command the operator builds for a 1-node x 1-GPU job, with three test substitutions:
    loopback ports, the master address, and the stand-in in place of `fast-llm train gpt --config ...`."""
    raw = yaml.safe_load((ROOT / "examples" / "fast-llm.yaml").read_text())["spec"]
    raw["trainer"]["gpusPerNode"] = 1
    # One native (CPU) server: Fast-LLM broadcasts over gloo to one rank.
    raw["inference"] = {**raw["inference"], "engine": "native", "tensorParallel": 1, "replicas": 1}
    raw["inference"].pop("resources", None)
    spec = parse_spec(raw)
    config = fastllm.training_config(spec, "ns", "job")
    relay_port, store_port, master_port = free_port(), free_port(), free_port()
    for client in (config["data"]["datasets"]["training"], config["callbacks"]["streaming"]):
        client["port"] = relay_port
    config["callbacks"]["streaming"]["broadcast"]["port"] = store_port
    config_path = tmp_path / "fast-llm.yaml"
    config_path.write_text(yaml.safe_dump(config))

    cmd = fastllm.pod_command(spec, "job", 0, master_port)
    cmd[cmd.index("--redis-listen") + 1] = f"127.0.0.1:{relay_port}"
    cmd[cmd.index("--redis-upstream") + 1] = f"127.0.0.1:{redis_port}"
    i = cmd.index("--broadcast-store-port")
    if store:
        cmd[i + 1] = str(store_port)
    else:
        del cmd[i:i + 2]
    cmd = [sys.executable if c == "python" else c for c in cmd]
    cmd = [f"--master-addr=127.0.0.1" if c.startswith("--master-addr=") else c for c in cmd]
    cmd = cmd[:cmd.index("--no-python") + 1] + [sys.executable, str(STAND_IN), str(config_path),
                                                 str(rendezvous_timeout_s)]
    return cmd, config


def _launch(cmd: list[str], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", fast_llm_launch.ENV_REDIS_PASSWORD: PASSWORD,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, start_new_session=True)


def _receive(addr: tuple[str, int], world: int, timeout_s: float) -> tuple[dict[str, torch.Tensor], str | None]:
    """The inference side of Fast-LLM's broadcast group, as both engines join it: rank 1 of `world`. The weights,
    and the generation of the store the group was joined through."""
    receiver = FastLlmReceiver(f"{addr[0]}:{addr[1]}", 1, world, timeout_s=timeout_s)
    receiver.join()  # Fast-LLM's rank 0 forms the group in its callback's constructor, before any weights_ready
    try:
        return receiver.receive(), receiver.generation
    finally:
        receiver.close()


def test_pod_command_gives_fast_llm_redis_and_the_broadcast_store(secured_redis, admin, tmp_path):
    cmd, config = _pod_command(tmp_path, secured_redis.port, store=True, rendezvous_timeout_s=60)
    admin.xgroup_create("fast_llm_streaming", "fast_llm_group", id="0", mkstream=True)
    admin.xadd("fast_llm_streaming", {"tokens": torch.tensor([5, 6, 7], dtype=torch.int64).numpy().tobytes()})
    proc = _launch(cmd, tmp_path)
    try:
        broadcast = config["callbacks"]["streaming"]["broadcast"]
        weights, generation = _receive(("127.0.0.1", broadcast["port"]), broadcast["external_world_size"] + 1, 60)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert {k: (v.dtype, v.tolist()) for k, v in weights.items()} == {
        "model.layers.0.weight": (torch.float32, [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])}
    events = [json.loads(f[b"event"]) for _, f in admin.xrange("fast_llm_events")]
    assert [e["type"] for e in events] == ["broadcast_opened", "weights_ready", "training_finished"]
    # The launcher announced its store's generation before Fast-LLM started; the receiver read the same from it.
    assert generation and events[0]["generation"] == generation
    # Under torchrun (agent store: the broadcast rendezvous is a client only), without the Secret in its env.
    assert "stand-in: rank 0 agent store True password in env False" in out, out
    assert "stand-in: document [5, 6, 7]" in out


def test_without_the_launchers_store_fast_llm_cannot_rendezvous(secured_redis, admin, tmp_path):
    # The negative control of the test above: the store is what makes the broadcast rendezvous work under torchrun.
    cmd, _ = _pod_command(tmp_path, secured_redis.port, store=False, rendezvous_timeout_s=3)
    admin.xgroup_create("fast_llm_streaming", "fast_llm_group", id="0", mkstream=True)
    admin.xadd("fast_llm_streaming", {"tokens": torch.tensor([1], dtype=torch.int64).numpy().tobytes()})
    proc = _launch(cmd, tmp_path)
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "stand-in: broadcast rendezvous failed" in out, out
    assert proc.returncode != 0


def test_exit_status_and_sigterm_pass_through(tmp_path):
    upstream = ("127.0.0.1", free_port())  # never connected to in this test
    base = [sys.executable, "-m", "rlkube.core.launch.fast_llm", "--redis-listen", f"127.0.0.1:{free_port()}",
            "--redis-upstream", f"{upstream[0]}:{upstream[1]}", "--"]
    assert subprocess.run([*base, sys.executable, "-c", "raise SystemExit(7)"], timeout=60).returncode == 7
    child = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(5)); "
             "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([*base, sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 5
    killed = subprocess.run([*base, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                            timeout=60)
    assert killed.returncode == 128 + signal.SIGKILL
