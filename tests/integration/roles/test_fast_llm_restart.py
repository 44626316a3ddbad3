"""A Fast-LLM trainer killed between updates and started again, as its pod's restart does: the inference server
rejoins the new trainer's broadcast group as soon as the trainer pod's launcher announces its new broadcast store
(protocol.BROADCAST_OPENED, rlkube.contract.fast_llm_rendezvous.GENERATION_KEY), not after a failed transfer, so the
new trainer's group constructor does not wait out its timeout; the trainer resumes from its checkpoint and every
step after it is trained exactly once.

Real parts: redis-server, the trainer pod's launcher (rlkube.core.launch.fast_llm: Redis relay, broadcast store,
generation announcement), the native inference server (the inference role's process). Fast-LLM is the stand-in
(fast_llm_stand_in.py: Fast-LLM's Redis and broadcast calls, and its checkpoint/resume of completed_steps and
documents_seen), started as the pod runs it (`fast-llm train gpt --config ...`, without torchrun: one rank).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import yaml
from support.hf_models import write_tiny_model
from rlkube.contract import protocol
from rlkube.controller.manifests import fastllm
from rlkube.lifecycle.validation import parse_spec
from rlkube.local.ports import free_port
from support.serve_helpers import RoleProcesses, http_json, log_text, wait_for, write_config
from support import DIR as SUPPORT

STAND_IN = SUPPORT / "fast_llm_stand_in.py"
STEPS, PER_STEP, KILLED_AFTER = 4, 3, 2
RENDEZVOUS_TIMEOUT_S = 120
"""The stand-in's broadcast timeout: a restarted trainer whose receivers do not rejoin exits 3 after it."""


def _documents(client, n: int) -> None:
    for i in range(n):
        client.xadd(protocol.DOCUMENTS_STREAM,
                    protocol.encode_document(protocol.Document(np.arange(3 + i % 3, dtype=np.int64)), ours=False))


def _health(url: str) -> dict:
    try:
        return http_json(url, timeout=5)[1]
    except OSError:  # not listening yet
        return {}


def _events(client) -> list[dict]:
    return [e.payload for i, f in client.xrange(protocol.EVENTS_STREAM)
            if (e := protocol.decode_event(i, f)) is not None]


def test_a_restarted_fast_llm_trainer_is_rejoined_and_resumes_from_its_checkpoint(tmp_path, redis_server,
                                                                                  redis_client):
    model = write_tiny_model(tmp_path / "model", "qwen2", "bpe", seed=3)
    raw = {
        "model": {"path": str(model), "dtype": "float32", "maxSequenceLength": 64},
        "task": {"name": "reverse-digits"},
        "algorithm": {"loss": "grpo", "maxSteps": STEPS, "groupSize": 3, "samplesPerStep": PER_STEP, "maxLag": 1,
                      "maxNewTokens": 4},
        "trainer": {"backend": "fast-llm", "gpusPerNode": 1, "fastLlm": {"modelFormat": "qwen2"},
                    "checkpoint": {"intervalSteps": 1}},
        "inference": {"engine": "native", "replicas": 1},
    }
    spec = parse_spec(raw)
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, raw))
    store_port = int(roles.weight_sync_addr.rsplit(":", 1)[1])
    relay_port = free_port()
    config = fastllm.training_config(spec, "ns", "job")
    for client in (config["data"]["datasets"]["training"], config["callbacks"]["streaming"]):
        client.update(host="127.0.0.1", port=relay_port)  # Fast-LLM's Redis: the launcher's relay
    config["callbacks"]["streaming"]["broadcast"].update(host="127.0.0.1", port=store_port)
    experiment = tmp_path / "experiment"  # the checkpoint volume, kept across the restart
    config["run"]["experiment_dir"] = str(experiment)
    assert config["training"]["checkpoint"]["interval"] == 1 and config["training"]["train_iters"] == STEPS
    (tmp_path / "fast-llm.yaml").write_text(yaml.safe_dump(config))
    # The pod's command (controller.manifests.fastllm.pod_command) with loopback ports, `fast-llm` run as the
    # stand-in.
    command = [sys.executable, "-m", "rlkube.core.launch.fast_llm", "--redis-listen", f"127.0.0.1:{relay_port}",
               "--redis-upstream", f"127.0.0.1:{redis_server.port}", "--broadcast-store-port", str(store_port),
               "--events-stream", protocol.EVENTS_STREAM, "--",
               sys.executable, str(STAND_IN), "train", "gpt", "--config", str(tmp_path / "fast-llm.yaml"),
               "--timeout-s", str(RENDEZVOUS_TIMEOUT_S)]

    def launch(n: int) -> subprocess.Popen:
        log = open(tmp_path / f"trainer-{n}.log", "wb")
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=roles.env(RANK="0", TORCHELASTIC_USE_AGENT_STORE="True"))
        log.close()
        proc.log_path = tmp_path / f"trainer-{n}.log"
        roles.procs.append(proc)
        return proc

    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    try:
        server = roles.start_role("inference", RLKUBE_PORT=str(port))
        first = launch(1)
        _documents(redis_client, KILLED_AFTER * PER_STEP)
        # Step KILLED_AFTER broadcast, served and checkpointed; the trainer now waits for the next step's documents.
        wait_for(lambda: _health(health).get("model_version") == KILLED_AFTER, 180,
                 lambda: f"the server to serve step {KILLED_AFTER}; trainer: {log_text(first)[-2000:]}")
        wait_for(lambda: (experiment / "checkpoint" / str(KILLED_AFTER)).is_dir(), 30, "the checkpoint")
        os.killpg(first.pid, signal.SIGKILL)  # the pod is killed: launcher, store and trainer at once
        first.wait(timeout=30)

        started = time.monotonic()
        second = launch(2)
        _documents(redis_client, (STEPS - KILLED_AFTER) * PER_STEP)
        assert second.wait(timeout=RENDEZVOUS_TIMEOUT_S + 60) == 0, log_text(second)[-3000:]
        took = time.monotonic() - started
        # The new group formed without waiting for the trainer's broadcast timeout (the receiver did not wait
        # for a failed transfer: there was none, the trainer died between updates).
        assert took < RENDEZVOUS_TIMEOUT_S, (took, log_text(second)[-3000:])

        out1, out2 = log_text(first), log_text(second)
        assert "stand-in: broadcast group formed" in out2, out2[-3000:]
        assert f"stand-in: resumed from checkpoint {KILLED_AFTER} ({KILLED_AFTER * PER_STEP} documents seen)" \
            in out2, out2[-3000:]
        trained = [int(line.split()[3]) for out in (out1, out2) for line in out.splitlines()
                   if line.startswith("stand-in: trained step")]
        assert trained == list(range(1, STEPS + 1)), trained  # each step once: none lost, none repeated

        events = _events(redis_client)
        opened = [e["generation"] for e in events if e["type"] == protocol.BROADCAST_OPENED]
        assert len(opened) == 2 and opened[0] != opened[1], events
        ready = [(e["step"], e["documents_seen"]) for e in events if e["type"] == protocol.WEIGHTS_READY]
        assert ready == [(s, s * PER_STEP) for s in range(KILLED_AFTER + 1)] + \
            [(s, s * PER_STEP) for s in range(KILLED_AFTER, STEPS + 1)], ready
        # Every document was read once: the stream's group read all of them and has none left.
        (group,) = redis_client.xinfo_groups(protocol.DOCUMENTS_STREAM)
        assert (group["entries-read"], group["lag"]) == (STEPS * PER_STEP, 0), group

        state = wait_for(lambda: (h := _health(health)).get("training_finished") and h, 60,
                         "the server to take the last update and training_finished")
        assert state["model_version"] == STEPS
        sent = {int(line.split()[2]): float(line.split()[3]) for line in out2.splitlines()
                if line.startswith("stand-in: checksum")}
        assert abs(state["weights_checksum"] - sent[STEPS]) <= 1e-9 * max(1.0, abs(sent[STEPS]))
        served_log = log_text(server)
        assert f"Fast-LLM's trainer opened broadcast generation {opened[1]}" in served_log, served_log[-3000:]
        assert server.poll() is None, served_log[-3000:]
    finally:
        roles.cleanup()
