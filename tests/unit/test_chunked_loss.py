"""The loss's log-probs and entropy taken chunk by chunk from the final hidden states
(rlkube.core.losses.chunked_token_logprobs) equal the full-logits path (token_logprobs / token_entropy / batch_loss):
loss, statistics and gradients to 1e-5, for any chunk size, at temperature 1 and not, untied and tied LM heads, and
through TorchBackend.forward_backward. Memory numbers: `rlkube bench loss-memory` (rlkube.bench.loss_memory)."""

import copy

import numpy as np
import pytest
import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from rlkube.core.backends.base import batch_loss, logprob_loss
from rlkube.core.backends.torch_backend import TorchBackend
from rlkube.core.batch import collate
from rlkube.core.losses import LossConfig, chunked_token_logprobs, token_entropy, token_logprobs

from hf_models import builtin_dir, write_tiny_model

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _full_and_chunked(chunk, temperature, tied=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t, h, v = 3, 11, 8, 37
    hidden = torch.randn(b, t, h, generator=g)
    tokens = torch.randint(0, v, (b, t), generator=g)
    weights = torch.randn(b, t - 1, generator=g)
    head = torch.nn.Linear(h, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g))
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
