"""The loss's log-probs and entropy taken chunk by chunk from the final hidden states
(rlkube.core.training.losses.chunked_token_logprobs) equal the full-logits path (token_logprobs / token_entropy /
batch_loss): loss, statistics and gradients to 1e-5, for any chunk size, at temperature 1 and not, untied and tied LM
heads, the heads the backends pass (with a bias, bfloat16, LoRA-adapted, frozen hidden states), the KL and off-policy
terms, and through TorchBackend.forward_backward; a float64 gradient check of the chunked log-probs (the backward is
written by hand: losses._LogprobEntropy). Memory: the chunked loss step adds at most 0.1 of what the full-logits one
adds (`rlkube bench loss-memory`, rlkube.bench.loss_memory, at a smaller size here; its defaults are in the bench)."""

import copy
import json

import numpy as np
import pytest
import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from rlkube.core.backends.base import batch_loss, logprob_loss
from rlkube.core.backends.torch_backend import TorchBackend
from rlkube.core.training.batch import collate
from rlkube.core.training.losses import (LossConfig, OffPolicyConfig, VocabParallel, chunked_token_logprobs,
                                         token_entropy, token_logprobs)

from support.hf_models import builtin_dir, write_tiny_model

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(seed=0):
    """Hidden states [3, 11, 8], tokens and per-token weights, and a head onto a vocabulary of 37, from `seed`."""
    g = torch.Generator().manual_seed(seed)
    b, t, h, v = 3, 11, 8, 37
    hidden = torch.randn(b, t, h, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    weights = torch.randn(b, t - 1, generator=g)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    return hidden, tokens, weights, head


def _full_and_chunked(chunk, temperature, tied=False, seed=0):
    hidden, tokens, weights, head = _inputs(seed)
    results = []
    for chunked in (False, True):
        hd = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            logp, entropy = chunked_token_logprobs(hd, head, tokens, temperature, chunk)
        else:
            logits = head(hd)
            logp, entropy = token_logprobs(logits, tokens, temperature), token_entropy(logits[:, :-1])
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy, hd.grad, head.weight.grad.clone()))
    return results


@pytest.mark.parametrize("chunk", [1, 4, 7, 30, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_path(chunk, temperature):
    full, chunked = _full_and_chunked(chunk, temperature)
    for want, got in zip(full, chunked, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_chunk_size_must_be_positive():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_token_logprobs(torch.zeros(1, 3, 2), torch.nn.Linear(2, 5), torch.zeros(1, 3, dtype=torch.long),
                               chunk_size=0)


def _docs(n=4, length=9, vocab=20, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tokens = rng.integers(3, vocab, size=length - i).astype(np.int64)
        old = np.zeros(len(tokens), dtype=np.float32)
        old[3:] = rng.normal(-3.0, 0.3, size=len(tokens) - 3)
        out.append(protocol.Document(tokens, [(0, 3)], advantage=float(rng.normal()), reward=0.5,
                                     old_log_probabilities=old, model_version=np.zeros(len(tokens), dtype=np.int64)))
    return out


@pytest.mark.parametrize("loss", ["grpo", "gspo", "sft"])
@pytest.mark.parametrize("tied", [False, True])
def test_backend_forward_backward_equals_the_full_logits_loss(tmp_path, loss, tied):
    """TorchBackend.forward_backward (chunked, 3 tokens a chunk) vs batch_loss on the full logits: loss, statistics
    and every parameter's gradient to 1e-5 (the tied case: Qwen2's tied embedding gets both gradients)."""
    model_dir = write_tiny_model(tmp_path / "m", "qwen2") if tied else builtin_dir()
    spec: TrainingJobSpec = parse_spec({
        "model": {"path": str(model_dir) if tied else "builtin://tiny-llama", "maxSequenceLength": 16},
        "algorithm": {"maxSteps": 3, "samplesPerStep": 4, "loss": loss, "temperature": 0.8},
        "inference": {"engine": "native"},
        # sft trains on a dataset's reference completions (validation asks for the field; nothing reads it here)
        **({"task": {"dataset": {"path": "/data/sft.jsonl", "completionField": "completion"}}} if loss == "sft"
           else {}),
    })
    chunked = TorchBackend(spec, model_dir)
    assert chunked.model.config.tie_word_embeddings == tied
    chunked.loss_chunk_tokens = 3
    full = copy.deepcopy(chunked)
    batch = collate(_docs(), full.pad_id)
    normalizer = float(batch.num_loss_tokens)
    want = batch_loss(full.logits(batch.tokens), batch, full.loss_config, full.temperature, normalizer)
    want.loss.backward()
    got_stats = chunked.forward_backward(batch, normalizer)
    for name, value in want.stats.metrics(normalizer).items():
        assert got_stats.metrics(normalizer)[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    want_grads = dict(full.model.named_parameters())
    for name, p in chunked.model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[name].grad, **TOL)


def test_logprob_loss_is_batch_loss_of_the_same_logprobs():
    batch = collate(_docs(), 0)
    logits = torch.randn(*batch.tokens.shape, 20, requires_grad=True)
    config = LossConfig("grpo")
    a = batch_loss(logits, batch, config, 1.0, 7.0)
    b = logprob_loss(token_logprobs(logits, batch.tokens), token_entropy(logits[:, :-1]), batch, config, 7.0)
    assert a.loss.item() == b.loss.item() and a.stats == b.stats


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_pass_a_float64_gradient_check(chunk, temperature):
    """torch.autograd.gradcheck against finite differences, for the hidden states, the head's weight and bias. It
    also backwards through the same graph many times (retain_graph): every backward recomputes the chunk's logits."""
    g = torch.Generator().manual_seed(1)
    b, t, h, v = 2, 7, 4, 11
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, v, (b, t), generator=g)

    def logp(hd, w, bs):
        out, entropy = chunked_token_logprobs(hd, lambda x: torch.nn.functional.linear(x, w, bs), tokens,
                                              temperature, chunk)
        assert out.dtype == torch.float64 and not entropy.requires_grad
        return out

    assert torch.autograd.gradcheck(logp, (hidden, weight, bias))


def test_a_retained_graph_backwards_twice_to_twice_the_gradient():
    full, _ = _full_and_chunked(4, 0.7)
    hidden, tokens, weights, head = _inputs()
    hidden.requires_grad_(True)
    logp, _ = chunked_token_logprobs(hidden, head, tokens, 0.7, 4)
    loss = (logp * weights).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(hidden.grad, 2 * full[2], **TOL)
    torch.testing.assert_close(head.weight.grad, 2 * full[3], **TOL)


def _lora_head(h, v):
    import peft
    from peft.tuners.lora.layer import Linear as LoraLinear

    config = peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False)  # random A and B: the adapter counts
    return LoraLinear(torch.nn.Linear(h, v, bias=False), "default", config, r=2, lora_alpha=4,
                      init_lora_weights=False)


@pytest.mark.parametrize("kind", ["bias", "bfloat16", "lora", "frozen-hidden"])
def test_the_heads_the_backends_pass_equal_the_full_path(kind):
    """nn.Linear with a bias; a bfloat16 head (its logits cast to float32, as the megatron backend's); a PEFT LoRA
    layer on the head; hidden states without gradient (only the head trains: LoRA on the LM head alone)."""
    torch.manual_seed(0)
    b, t, h, v = 3, 10, 8, 29
    head = {"bias": lambda: torch.nn.Linear(h, v), "bfloat16": lambda: torch.nn.Linear(h, v).bfloat16(),
            "lora": lambda: _lora_head(h, v), "frozen-hidden": lambda: torch.nn.Linear(h, v, bias=False)}[kind]()
    hidden = torch.randn(b, t, h)
    tokens = torch.randint(0, v, (b, t))
    weights = torch.randn(b, t - 1)
    results = []
    for chunked in (False, True):
        hd = hidden.clone().to(next(head.parameters()).dtype).requires_grad_(kind != "frozen-hidden")
        head.zero_grad(set_to_none=True)
        if chunked:
            logp, entropy = chunked_token_logprobs(hd, lambda x: head(x).float(), tokens, 0.8, 4)
        else:
            logits = head(hd).float()
            logp, entropy = token_logprobs(logits, tokens, 0.8), token_entropy(logits[:, :-1])
        (logp * weights).sum().backward()
        results.append([logp.detach(), entropy, hd.grad] + [p.grad.float() for p in head.parameters()])
    tol = {"rtol": 1e-2, "atol": 1e-2} if kind == "bfloat16" else TOL  # bfloat16 matmuls of different shapes
    for want, got in zip(*results, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, **tol)


def test_the_vocabulary_parallel_path_on_one_rank_equals_the_full_path():
    """VocabParallel with one rank (all-reduces that do nothing): the tensor-parallel branch's arithmetic; the real
    two-rank run is the megatron tier's tests/integration/roles/test_megatron_parallel.py."""
    full, _ = _full_and_chunked(4, 0.7)
    hidden, tokens, weights, head = _inputs()
    hidden.requires_grad_(True)
    logp, entropy = chunked_token_logprobs(hidden, head, tokens, 0.7, 4,
                                           VocabParallel(0, lambda x: None, lambda x: x))
    (logp * weights).sum().backward()
    for want, got in zip(full, (logp.detach(), entropy, hidden.grad, head.weight.grad), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("config", [
    LossConfig("grpo", kl_coef=0.3, off_policy=OffPolicyConfig("tis", cap=1.5)),
    LossConfig("gspo", kl_coef=0.1, off_policy=OffPolicyConfig("mis", level="sequence", cap=3.0)),
    LossConfig("reinforce", kl_coef=0.2),
], ids=["grpo-kl-tis", "gspo-kl-mis", "reinforce-kl"])
def test_the_loss_with_kl_and_off_policy_terms_equals_the_full_logits_loss(config):
    """logprob_loss on the chunked log-probs vs batch_loss on the full logits with a reference policy (the k3 KL term
    has a gradient through the log-probs) and an off-policy correction: loss, every statistic, the gradients of the
    hidden states and of the head."""
    batch = collate(_docs(), 0)
    g = torch.Generator().manual_seed(3)
    b, t = batch.tokens.shape
    h, v = 6, 20
    hidden = torch.randn(b, t, h, generator=g)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
    ref = torch.randn(b, t - 1, generator=g) - 3.0
    results = []
    for chunked in (False, True):
        hd = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        if chunked:
            logp, entropy = chunked_token_logprobs(hd, head, batch.tokens, 0.9, 5)
            out = logprob_loss(logp, entropy, batch, config, 11.0, ref)
        else:
            out = batch_loss(head(hd), batch, config, 0.9, 11.0, ref)
        out.loss.backward()
        results.append((out, hd.grad, head.weight.grad.clone()))
    (want, want_h, want_w), (got, got_h, got_w) = results
    assert want.stats.ref_kl_tokens > 0 and want.stats.is_ratios > 0
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    for name, value in want.stats.metrics(11.0).items():
        assert got.stats.metrics(11.0)[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    torch.testing.assert_close(got_h, want_h, **TOL)
    torch.testing.assert_close(got_w, want_w, **TOL)


def test_the_chunked_loss_step_adds_at_most_a_tenth_of_the_full_logits_one(capsys, monkeypatch):
    """`rlkube bench loss-memory` at vocabulary 65,536 and 1,024 tokens (its defaults, 151,936 and 4,096, take
    minutes: the bench). glibc's fixed mmap threshold: every tensor over 128 KiB is its own mapping, returned to the
    system when freed, so the peak RSS is what the loss holds (its dynamic threshold otherwise keeps freed blocks of
    up to 32 MiB, noise at this size) - the children inherit it."""
    from rlkube.bench import loss_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    assert loss_memory.main(["--vocab", "65536", "--tokens", "1024", "--chunk", "128"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    one_copy = 65536 * 1024 * 4
    assert result["full_added_bytes"] > 3 * one_copy  # the full path holds several [tokens, V] tensors
    assert result["ratio"] <= 0.1, result
    assert result["loss_difference"] < 1e-5 and max(result["max_gradient_difference"].values()) < 1e-6

