"""The native engine serving a `trainer.backend: fast-llm` job: it joins Fast-LLM's broadcast group at start-up,
receives each update as Fast-LLM sends it (fast_llm_stand_in.py runs Fast-LLM's broadcast code over gloo, with
the weights of a tied-embedding Qwen2 checkpoint under their HF names, and overshoots docs_per_step as Fast-LLM
does), becomes healthy, and serves exactly the broadcast weights (its checksum equals the stand-in's)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import yaml
from support.hf_models import write_tiny_model
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import fastllm
from rlkube.contract import protocol
from rlkube.core.launch import fast_llm as fast_llm_launch
from rlkube.local.ports import free_port
from support.serve_helpers import RoleProcesses, http_json, http_status, wait_for, write_config

from support import DIR as SUPPORT
PER_STEP, OVERSHOOT, STEPS = 4, 1, 2


def test_native_engine_receives_fast_llms_broadcast(tmp_path, redis_server, redis_client):
    model = write_tiny_model(tmp_path / "model", "qwen2", "bpe", seed=3)
    raw = {
        "model": {"path": str(model), "dtype": "float32", "maxSequenceLength": 64},
        "task": {"name": "reverse-digits"},
        "algorithm": {"loss": "grpo", "maxSteps": STEPS, "groupSize": 2, "samplesPerStep": PER_STEP, "maxLag": 1,
                      "maxNewTokens": 4},
        "trainer": {"backend": "fast-llm", "gpusPerNode": 1, "fastLlm": {"modelFormat": "qwen2"}},
        "inference": {"engine": "native", "replicas": 1},
    }
    spec = parse_spec(raw)
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, raw))
    store_host, store_port = roles.weight_sync_addr.rsplit(":", 1)
    config = fastllm.training_config(spec, "ns", "job")
    assert config["callbacks"]["streaming"]["broadcast"]["backend"] == "gloo"
    for client in (config["data"]["datasets"]["training"], config["callbacks"]["streaming"]):
        client.update(host="127.0.0.1", port=redis_server.port)
    config["callbacks"]["streaming"]["broadcast"].update(host=store_host, port=int(store_port))
    (tmp_path / "fast-llm.yaml").write_text(yaml.safe_dump(config))
    store = fast_llm_launch.host_broadcast_store(int(store_port))  # what the trainer pod's launcher hosts
    port = free_port()
    try:
        server = roles.start_role("inference", RLKUBE_PORT=str(port))
        for i in range(STEPS * (PER_STEP + OVERSHOOT)):
            redis_client.xadd(protocol.DOCUMENTS_STREAM,
                              protocol.encode_document(protocol.Document(np.arange(3 + i % 3, dtype=np.int64))))
        trainer = subprocess.Popen(
            [sys.executable, str(SUPPORT / "fast_llm_stand_in.py"), str(tmp_path / "fast-llm.yaml"), "120",
             "--model", str(model), "--steps", str(STEPS), "--overshoot", str(OVERSHOOT)],
            env=roles.env(RANK="0", TORCHELASTIC_USE_AGENT_STORE="True"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        roles.procs.append(trainer)
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, out
        sent = {int(line.split()[2]): float(line.split()[3]) for line in out.splitlines()
                if line.startswith("stand-in: checksum")}
        assert sorted(sent) == [0, 1, 2]
        health = wait_for(lambda: (h := http_json(f"http://127.0.0.1:{port}/health")[1]).get("training_finished")
                            and h, 60, "the server to take every update and training_finished")
        assert http_status(f"http://127.0.0.1:{port}/health") == 200
        assert (health["model_version"], health["epoch"], health["updates"]) == (STEPS, "fast-llm", STEPS + 1)
        assert abs(health["weights_checksum"] - sent[STEPS]) <= 1e-9 * max(1.0, abs(sent[STEPS]))
        # Fast-LLM's events carry the true documents_seen (docs_per_step + overshoot per step).
        seen = [protocol.decode_event(i, f).payload for i, f in redis_client.xrange(protocol.EVENTS_STREAM)]
        assert [p.get("documents_seen") for p in seen if p["type"] == "weights_ready"] == \
            [0, PER_STEP + OVERSHOOT, 2 * (PER_STEP + OVERSHOOT)]
        assert server.poll() is None
    finally:
        roles.cleanup()
        del store
