"""The model families a job may name work end to end (docs/design.md §6): for tiny random Llama, Qwen2 and Qwen3
models built here (grouped-query attention; Qwen2 and Qwen3 with tied embeddings; Llama with the character tokenizer,
the Qwens with a byte-level BPE tokenizer trained here): the torch backend loads the directory and trains, the
checkpoint is a HF directory that transformers loads with the trainer's logits, and the native engine, updated in
flight through the real weight path (WeightPublisher -> gloo group -> WeightFollower, announced on Redis), samples
with the trainer's log-probs. Everything float32, so the tolerances are float32 rounding (logits 1e-5, log-probs
1e-4)."""

from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch
from cluster.control_plane import free_port
from support.hf_models import write_tiny_model
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import load_model, load_tokenizer
from rlkube.core.inference.native_engine import NativeEngine
from rlkube.core.inference.shell import WeightFollower
from rlkube.core.training.losses import token_logprobs
from rlkube.core.inference.sampling import GenerationRequest, SamplingEngine
from rlkube.core.trainer import Trainer
from rlkube.core.weights.group import WeightReceiver
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import checksums_match, weights_checksum
from support.waiting import wait_for

CASES = [("llama", "char", "LlamaForCausalLM"), ("qwen2", "bpe", "Qwen2ForCausalLM"),
         ("qwen3", "bpe", "Qwen3ForCausalLM")]
TEXTS = ["What is 3 + 4? The answer is 7.", "Repeat the digit 5: 555", "what is 12 + 9? 21"]


def documents(tok, n: int, seed: int) -> list[protocol.Document]:
    """Training documents of real text: the prompt (first half) excluded, made-up sampling log-probs."""
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        ids = np.array(tok.encode(TEXTS[i % len(TEXTS)]), dtype=np.int64)
        prompt = len(ids) // 2
        old = np.zeros(len(ids), dtype=np.float32)
        old[prompt:] = -rng.uniform(2.0, 5.0, len(ids) - prompt)
        docs.append(protocol.Document(ids, [(0, prompt)], advantage=float(rng.normal()), reward=0.5,
                                      old_log_probabilities=old, model_version=np.zeros(len(ids), dtype=np.int64)))
    return docs


@pytest.mark.parametrize(("arch", "tokenizer", "cls"), CASES)
def test_load_train_checkpoint_reload_and_serve_after_an_in_flight_update(tmp_path, redis_client, arch, tokenizer,
                                                                          cls):
    model_dir = write_tiny_model(tmp_path / arch, arch, tokenizer)
    spec = parse_spec({"model": {"path": str(model_dir), "maxSequenceLength": 64},
                       "algorithm": {"maxSteps": 3, "samplesPerStep": 6, "learningRate": 1e-2},
                       "inference": {"engine": "native"}})
    tok = load_tokenizer(model_dir)
    trainer = Trainer(spec, checkpoint_dir=tmp_path / "ckpt")
    assert type(trainer.model).__name__ == cls
    tied = hf_state.tied_aliases(trainer.model)
    assert bool(tied) == (arch != "llama")  # the Qwens tie lm_head to the embedding: sent and saved once
    assert not set(tied) & {n for n, _ in trainer.backend.weights()}

    # The engine starts from the same directory, and follows the trainer's announcements on Redis.
    keys = protocol.StreamKeys(f"test/{arch}/")
    addr = f"127.0.0.1:{free_port()}"
    served = load_model(model_dir)
    engine = SamplingEngine(served, tok, version=0, seed=1)
    receiver = WeightReceiver(addr, rank=1, world_size=2, timeout_s=30, local_host="127.0.0.1")
    follower = WeightFollower(redis_client, keys, NativeEngine(engine, receiver, copy.deepcopy(served))).start()
    publisher = WeightPublisher(redis_client, keys, addr, 2, timeout_s=30, local_host="127.0.0.1",
                                transfer_dtype=torch.float32)
    try:
        start = threading.Thread(target=publisher.start, args=(trainer.backend.weights(),), daemon=True)
        start.start()  # blocks until the follower has joined and received version 0
        start.join(60)
        assert follower.synced.wait(30) and engine.policy.version == 0

        for step in range(2):
            metrics = trainer.train_step(documents(tok, 6, seed=step))
            assert metrics["grad_norm"] > 0
        publisher.publish(trainer.backend.weights(), version=trainer.version, step=trainer.step)
        wait_for(lambda: engine.policy.version == 2, 30, "the in-flight update (policy version 2)")
        assert checksums_match(follower.served_checksum, weights_checksum(trainer.backend.weights()))

        # Checkpoint = HF directory: transformers loads it as it is, with the trainer's logits.
        path = trainer.save_checkpoint()
        reloaded = load_model(path, torch.float32)
        assert type(reloaded).__name__ == cls
        batch = trainer.make_batch(documents(tok, 3, seed=9))
        with torch.no_grad():
            want = trainer.backend.logits(batch.tokens)
            got = reloaded(batch.tokens).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        with torch.no_grad():  # and the training moved them: the comparisons below could fail
            assert (served(batch.tokens).logits - want).abs().max() > 1e-2
        assert load_tokenizer(path).encode(TEXTS[0]) == tok.encode(TEXTS[0])

        # The engine's sampling log-probs after the update are the trainer's (prompts of different lengths in one
        # batch: left padding and the KV cache must not change them).
        prompts = [tok.encode("What is 3 + 4?"), tok.encode("Repeat")]
        reqs = [GenerationRequest(p, n=3, max_tokens=6, temperature=1.0, top_logprobs=0, seed=i)
                for i, p in enumerate(prompts)]
        results = engine.generate(reqs)
        compared = 0
        for req, result in zip(reqs, results, strict=True):
            assert result.version == 2
            for c in result.completions:
                tokens = torch.tensor([req.prompt_ids + c.token_ids])
                with torch.no_grad():
                    trainer_lp = token_logprobs(trainer.backend.logits(tokens), tokens)[0, len(req.prompt_ids) - 1:]
                assert c.logprobs == pytest.approx(trainer_lp.tolist(), abs=1e-4)
                compared += len(c.logprobs)
        assert compared >= 6
    finally:
        follower.stop(5)
        publisher.close()
