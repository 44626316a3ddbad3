"""spec.trainer.lora with `inference.engine: vllm` (docs/design.md §6): the LoRA trainer publishes its MERGED full
weights (kind "full", base + scaling x B @ A under the HF names; docs/design.md §5.6) through the real weight-update
group (WeightPublisher -> gloo -> the vLLM workers), and the vLLM server's log-probs after the update are the
trainer's (PEFT model, base + adapter) to LOGPROB_TOLERANCE, as test_vllm_server.py bounds vLLM's CPU kernels
against an eager float32 reference, while the base model's are far off (the update landed). The transfer's bytes
are the full model's, reported beside the adapter's.

A vLLM server of its own (~30-60 s to start on 2 cores), started as every launcher starts it; the trainer is the
real rlkube.core.trainer.Trainer in this process. Skipped without the vLLM environment (`make deps-vllm`).
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import redis
import torch
from rlkube.contract import protocol
from rlkube.core.hf.loading import load_model
from rlkube.core.training.losses import token_logprobs
from rlkube.core.trainer import Trainer
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import FULL, checksums_match, transfer_dtype, update_nbytes
from rlkube.lifecycle.validation import parse_spec
from support.serve_helpers import (
    PREFIX, RoleProcesses, free_port, http_json, http_status, job_spec, log_text, wait_for, write_config,
)
from support.lora_updates import TARGETS, documents
from test_vllm_server import LOGPROB_TOLERANCE, MAX_LEN, MODEL, PROMPT, VLLM_PYTHON, wait_version

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                       reason=f"no vLLM environment at {VLLM_PYTHON} (`make deps-vllm` builds it; "
                              f"or set {ENV_VLLM_PYTHON})"),
]

STEPS = 2


def lora_vllm_spec() -> dict:
    spec = job_spec(learningRate=0.03)
    spec["model"]["maxSequenceLength"] = MAX_LEN
    spec["trainer"] = {"lora": {"rank": 8, "alpha": 16, "targetModules": TARGETS}}
    spec["inference"] = {"engine": "vllm", "replicas": 1,
                         "vllm": {"extraEngineArgs": ["--block-size=32", "--max-num-seqs=32"]}}
    return spec


def test_vllm_serves_the_lora_trainers_merged_weights(tmp_path, redis_server):
    spec = lora_vllm_spec()
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = roles.start_role("inference", RLKUBE_PORT=str(port), RLKUBE_INDEX="0", **{ENV_VLLM_PYTHON: VLLM_PYTHON})
    parsed = parse_spec(spec)
    trainer = Trainer(parsed)  # the job's model (builtin://tiny-llama, seed 7): the server's base weights
    assert not trainer.sends_adapter
    publisher = WeightPublisher(client, protocol.StreamKeys(PREFIX), roles.weight_sync_addr, 2, timeout_s=120,
                                local_host="127.0.0.1",
                                transfer_dtype=transfer_dtype(parsed.trainer.weight_transfer.dtype))
    try:
        wait_for(lambda: http_status(url + "/v1/models") == 200 or proc.poll() is not None, 300, "the vLLM server")
        assert proc.poll() is None, f"the vLLM server exited with {proc.returncode}:\n{log_text(proc)}"
        publisher.start(trainer.weight_update(), version=0, step=0)
        wait_version(url, 0, timeout=180)
        print(f"vLLM server serving version 0 after {time.monotonic() - t0:.1f}s")

        for step in range(STEPS):
            assert trainer.train_step(documents(8, seed=step))["grad_norm"] > 0
        update = trainer.weight_update()
        packed = publisher.sender.pack(update)
        assert packed.meta["kind"] == FULL
        publisher.publish(update, version=trainer.version, step=trainer.step)
        served = wait_version(url, STEPS, timeout=120)
        assert checksums_match(served["weights_checksum"], packed.meta["checksum"])
        full_bytes = update_nbytes(packed.meta)
        adapter_bytes = update_nbytes(publisher.sender.pack(trainer.backend.adapter_update()).meta)
        n_params = sum(t.numel() for _, t in update)
        assert full_bytes == 4 * n_params  # float32 on CPU: every weight, merged
        print(f"LoRA -> vLLM update of version {STEPS}: merged full weights {full_bytes} bytes (the adapter alone "
              f"would be {adapter_bytes}); transfer {publisher.last_transfer_s * 1e3:.1f} ms")

        status, reply = http_json(url + "/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 6, "temperature": 1.0, "logprobs": 0,
            "seed": 11}, timeout=120)
        assert status == 200, reply
        assert reply["model_version"] == STEPS
        base = load_model(trainer.model_dir, torch.float32)
        worst, moved, compared = 0.0, 0.0, 0
        for choice in reply["choices"]:
            prompt_len = len(choice["prompt_token_ids"])
            tokens = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
            with torch.no_grad():
                want = token_logprobs(trainer.backend.logits(tokens), tokens)[0, prompt_len - 1:]
                at_base = token_logprobs(base(tokens).logits, tokens)[0, prompt_len - 1:]
            got = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
            assert len(got) == len(want) >= 1
            worst = max(worst, float((got - want).abs().max()))
            moved = max(moved, float((got - at_base).abs().max()))
            compared += len(got)
        print(f"{compared} served log-probs: max |vLLM - trainer (base + adapter)| {worst:.2e} (tolerance "
              f"{LOGPROB_TOLERANCE:.0e}); max |vLLM - base| {moved:.2e}")
        assert worst < LOGPROB_TOLERANCE
        assert moved > 30 * LOGPROB_TOLERANCE, "the adapter's update did not change the served distribution"
    finally:
        publisher.close()
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        roles.cleanup()  # SIGKILLs the server: vLLM's processes then end themselves (rlkube.core.inference.vllm_worker)
        _, alive = psutil.wait_procs(children, timeout=15)
        for child in alive:
            child.kill()
        client.close()
