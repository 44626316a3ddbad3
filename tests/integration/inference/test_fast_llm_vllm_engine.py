"""The vLLM engine serving a `trainer.backend: fast-llm` job: its worker joins Fast-LLM's broadcast group at start-up
(rank 1 + index x tensorParallel + tp_rank; gloo, as a CPU worker must), receives each update as Fast-LLM sends it
(fast_llm_stand_in.py: Fast-LLM's broadcast calls over gloo, the weights of a tied-embedding Qwen2 checkpoint under
their HF names, docs_per_step overshot as Fast-LLM does), loads it by HF name, becomes healthy after the first, and
serves exactly the broadcast weights: the checksum it reports is the stand-in's, and its log-probs are transformers'
with the stand-in's last weights.

One server per test (vLLM takes ~1 min to start on 2 cores): one worker, and tensorParallel 2 (two workers, each
its own rank of Fast-LLM's group: external_world_size = replicas x tensorParallel); the vllm tier
(test_vllm_server.py's marker and skip).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from support.hf_models import write_tiny_model
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import fastllm
from rlkube.contract import protocol
from rlkube.core.launch import fast_llm as fast_llm_launch
from rlkube.local.ports import free_port
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON
from support.serve_helpers import RoleProcesses, http_json, http_status, log_text, wait_for, write_config
from test_vllm_server import LOGPROB_TOLERANCE, VLLM_PYTHON, pytestmark

__all__ = ["pytestmark"]  # the vllm marker and the skip without a vLLM environment, as test_vllm_server's

from support import DIR as SUPPORT
PER_STEP, OVERSHOOT, STEPS = 4, 1, 2
MAX_LEN = 64


def stand_in_weights(model_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """What fast_llm_stand_in.py broadcasts at `step` (its model_weights moved by step x 1e-3)."""
    from support.fast_llm_stand_in import model_weights
    return {k: (v + step * 1e-3).to(v.dtype) if v.is_floating_point() and step else v
            for k, v in model_weights(str(model_dir)).items()}


def transformers_logprobs(model_dir: Path, state: dict[str, torch.Tensor], choice: dict) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: the embedding
    model.tie_weights()
    tokens = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
    with torch.no_grad():
        logits = model(tokens).logits.float()
    lp = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, tokens[0, 1:, None])[:, 0]
    return lp[len(choice["prompt_token_ids"]) - 1:].tolist()


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_engine_receives_fast_llms_broadcast(tmp_path, redis_server, redis_client, tp):
    model = write_tiny_model(tmp_path / "model", "qwen2", "bpe", seed=3)
    raw = {
        "model": {"path": str(model), "dtype": "float32", "maxSequenceLength": MAX_LEN},
        "task": {"name": "reverse-digits"},
        "algorithm": {"loss": "grpo", "maxSteps": STEPS, "groupSize": 2, "samplesPerStep": PER_STEP, "maxLag": 1,
                      "maxNewTokens": 4},
        "trainer": {"backend": "fast-llm", "gpusPerNode": 1, "fastLlm": {"modelFormat": "qwen2"}},
        "inference": {"engine": "vllm", "replicas": 1, "tensorParallel": tp,
                      "vllm": {"extraEngineArgs": ["--block-size=32", "--max-num-seqs=32"]}},
    }
    spec = parse_spec(raw)
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, raw))
    store_host, store_port = roles.weight_sync_addr.rsplit(":", 1)
    config = fastllm.training_config(spec, "ns", "job")
    # A GPU job's vLLM servers receive over NCCL; this CPU server's worker joins over gloo
    # (rlkube.core.inference.vllm_worker), so the stand-in broadcasts over gloo, as Fast-LLM does when so configured.
    assert config["callbacks"]["streaming"]["broadcast"]["backend"] == "nccl"
    config["callbacks"]["streaming"]["broadcast"].update(backend="gloo", host=store_host, port=int(store_port))
    assert config["callbacks"]["streaming"]["broadcast"]["external_world_size"] == tp
    for client in (config["data"]["datasets"]["training"], config["callbacks"]["streaming"]):
        client.update(host="127.0.0.1", port=redis_server.port)
    (tmp_path / "fast-llm.yaml").write_text(yaml.safe_dump(config))
    store = fast_llm_launch.host_broadcast_store(int(store_port))  # what the trainer pod's launcher hosts
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    try:
        server = roles.start_role("inference", RLKUBE_PORT=str(port), RLKUBE_INDEX="0",
                                  **{ENV_VLLM_PYTHON: VLLM_PYTHON})
        for i in range(STEPS * (PER_STEP + OVERSHOOT)):
            redis_client.xadd(protocol.DOCUMENTS_STREAM,
                              protocol.encode_document(protocol.Document(np.arange(3 + i % 3, dtype=np.int64))))
        trainer = subprocess.Popen(
            [sys.executable, str(SUPPORT / "fast_llm_stand_in.py"), str(tmp_path / "fast-llm.yaml"), "300",
             "--model", str(model), "--steps", str(STEPS), "--overshoot", str(OVERSHOOT)],
            env=roles.env(RANK="0", TORCHELASTIC_USE_AGENT_STORE="True"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        roles.procs.append(trainer)
        # /health is 503 until the first update (the stand-in cannot send one before the server joined).
        wait_for(lambda: http_status(url + "/v1/models") == 200 or server.poll() is not None, 300, "the server")
        assert server.poll() is None, log_text(server)
        out, _ = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, f"{out}\n{log_text(server)[-5000:]}"
        sent = {int(line.split()[2]): float(line.split()[3]) for line in out.splitlines()
                if line.startswith("stand-in: checksum")}
        assert sorted(sent) == list(range(STEPS + 1))
        health = wait_for(lambda: (h := http_json(url + "/health")[1]).get("training_finished") and h, 120,
                            "the server to take every update and training_finished")
        print(f"vLLM (tensorParallel {tp}) served Fast-LLM's {STEPS + 1} updates {time.monotonic() - t0:.1f}s after it started")
        assert http_status(url + "/health") == 200
        # Every update served; the group left at training_finished (epoch None), the ranks it joined as kept.
        assert (health["model_version"], health["epoch"], health["updates"]) == (STEPS, None, STEPS + 1)
        assert health["weight_sync_ranks"] == list(range(1, 1 + tp)) and health["rejected_updates"] == 0
        assert abs(health["weights_checksum"] - sent[STEPS]) <= 1e-9 * max(1.0, abs(sent[STEPS])), health
        log = log_text(server)
        assert f"joined Fast-LLM's weight broadcast as ranks {list(range(1, 1 + tp))} of {1 + tp}" in log, log[-5000:]

        # The log-probs served are those of the last broadcast weights (and far from the first's).
        status, reply = http_json(url + "/v1/completions", {"prompt": "12345:", "n": 2, "max_tokens": 4,
                                                            "temperature": 1.0, "logprobs": 0, "seed": 7},
                                  timeout=120)
        assert status == 200 and reply["model_version"] == STEPS, reply
        last, first = stand_in_weights(model, STEPS), stand_in_weights(model, 0)
        for choice in reply["choices"]:
            got = choice["logprobs"]["token_logprobs"]
            want = transformers_logprobs(model, last, choice)
            old = transformers_logprobs(model, first, choice)
            assert len(got) == len(want) >= 1
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < LOGPROB_TOLERANCE, (got, want)
            assert max(abs(a - b) for a, b in zip(got, old, strict=True)) > 10 * LOGPROB_TOLERANCE, (got, old)
        assert server.poll() is None
    finally:
        roles.cleanup()
        del store
