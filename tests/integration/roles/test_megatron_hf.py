"""Hugging Face models in megatron-core (megatron tier): tiny random Llama, Qwen2 and Qwen3 checkpoints written by
transformers in the test are loaded into a GPTModel, exported back exactly, compute the transformers model's
logits, and give the same loss, gradients and gradient norm for a grpo and an sft batch.

Tolerances (float32, CPU, measured over these configs with initializer_range 0.1 so that attention is far from
uniform and a wrong RoPE convention or QKV grouping moves logits by > 1, see test_a_wrong_layout_is_visible):
logits within 5e-5 absolute (measured <= 5e-6); loss within 1e-5 relative (measured <= 2e-7); gradient norm
within 1e-5 relative (measured <= 5e-7); every gradient element within 1e-4 relative + 1e-6 absolute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.contract import protocol
from rlkube.core.backends.base import batch_loss
from rlkube.core.training.batch import collate
from rlkube.core.training.losses import LossConfig, token_logprobs

pytestmark = [
    pytest.mark.megatron,
    # megatron 0.16 warns on every tensor-parallel layer call without an explicit tp_group (size 1 here)
    pytest.mark.filterwarnings("ignore:.*tp_group is None:DeprecationWarning"),
]

VOCAB = 96
LOGITS_ATOL = 5e-5
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-5

# (id, config class name, overrides): GQA everywhere (4 query heads, 2 key/value heads) unless stated
MODELS = [
    ("llama", "LlamaConfig", {}),
    ("llama-tied", "LlamaConfig", {"tie_word_embeddings": True}),
    ("llama-mha", "LlamaConfig", {"num_key_value_heads": 4}),
    ("qwen2", "Qwen2Config", {}),
    ("qwen2-tied", "Qwen2Config", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen3", "Qwen3Config", {"head_dim": 32}),  # head_dim * heads != hidden_size, q/k norms
]


def hf_config(cls_name: str, **overrides):
    import transformers

    fields = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "initializer_range": 0.1, "rope_theta": 1000.0,
    }
    fields.update(overrides)
    return getattr(transformers, cls_name)(**fields)


def write_model(tmp_path, cls_name: str, seed: int = 0, **overrides):
    """A random transformers model saved with save_pretrained; its norms and biases are perturbed away from their
    1/0 initialisation so that a mix-up between them is visible. Returns (model in eval mode, directory)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(cls_name, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path / "hf"
    model.save_pretrained(path)
    return model.eval(), path


def load(path, dtype=torch.float32):
    from rlkube.core.backends.megatron_gpt import MegatronGPT

    return MegatronGPT.from_hf_dir(path, dtype)


def read_hf_weights(path):
    from rlkube.core.training.checkpoint import load_weights

    return load_weights(path)


def tokens_of(seed: int, batch: int = 3, length: int = 48) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cls_name, overrides", [m[1:] for m in MODELS], ids=[m[0] for m in MODELS])
def test_round_trip_is_exact_and_logits_match(tmp_path, cls_name, overrides):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoModelForCausalLM

    hf, path = write_model(tmp_path, cls_name, **overrides)
    gpt = load(path)
    assert isinstance(gpt.model, GPTModel)
    assert (gpt.model.output_layer.weight is None) == bool(overrides.get("tie_word_embeddings"))
    exported = gpt.export_hf_state_dict()
    want = read_hf_weights(path)  # the directory's safetensors: a tied embedding once
    assert list(exported) != [] and sorted(exported) == sorted(want)
    for name, tensor in want.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # what comes out loads into a fresh transformers model (tied: lm_head.weight is the embedding itself), which
    # then computes the same logits
    fresh = AutoModelForCausalLM.from_config(hf.config).eval()
    result = fresh.load_state_dict({k: v.clone() for k, v in exported.items()}, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == (["lm_head.weight"] if gpt.arch.tied else [])
    tokens = tokens_of(1)
    with torch.no_grad():
        want_logits, got_logits, fresh_logits = hf(tokens).logits, gpt.logits(tokens), fresh(tokens).logits
    diff = float((got_logits - want_logits).abs().max())
    print(f"{cls_name} {overrides}: max |logit| {float(want_logits.abs().max()):.2f}, max |diff| {diff:.2e}")
    assert diff < LOGITS_ATOL
    assert torch.equal(fresh_logits, want_logits)


def test_llama3_rope_scaling(tmp_path):
    """Llama 3.x checkpoints scale RoPE frequencies; megatron's rope_scaling computes the same ones."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf, path = write_model(tmp_path, "LlamaConfig", rope_parameters=rope, max_position_embeddings=8192)
    gpt = load(path)
    tokens = tokens_of(2, length=64)
    with torch.no_grad():
        diff = float((gpt.logits(tokens) - hf(tokens).logits).abs().max())
    assert diff < LOGITS_ATOL


def test_a_wrong_layout_is_visible(tmp_path):
    """The tolerance above can fail: interleaved RoPE or ungrouped QKV rows move the logits by far more."""
    hf, path = write_model(tmp_path, "Qwen2Config")
    tokens = tokens_of(3)
    with torch.no_grad():
        want = hf(tokens).logits
    gpt = load(path)
    params = dict(gpt.model.named_parameters())
    sd = hf.state_dict()
    with torch.no_grad():
        params["decoder.layers.0.self_attention.linear_qkv.weight"].copy_(torch.cat(
            [sd[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]))
        assert float((gpt.logits(tokens) - want).abs().max()) > 100 * LOGITS_ATOL
    gpt = load(path)
    for module in gpt.model.modules():
        if hasattr(module, "rotary_interleaved"):
            module.rotary_interleaved = True
            module.forward.cache_clear()
    with torch.no_grad():
        assert float((gpt.logits(tokens) - want).abs().max()) > 100 * LOGITS_ATOL


def documents(old_logp: torch.Tensor | None, tokens: torch.Tensor, seed: int) -> list[protocol.Document]:
    """Prompt of 6 tokens (excluded from the loss), varied completion lengths (padding inside the batch),
    sampling log-probs `old_logp` [B, T] (0 on the prompt) when given, advantages of both signs."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(tokens.shape[0]):
        length = int(rng.integers(14, tokens.shape[1] + 1))
        old = None if old_logp is None else old_logp[i, :length].numpy().astype(np.float32)
        out.append(protocol.Document(tokens[i, :length].numpy().astype(np.int64), [(0, 6)],
                                     advantage=float(rng.normal()), reward=0.0, old_log_probabilities=old,
                                     model_version=np.zeros(length, dtype=np.int64)))
    return out


def grad_step(logits_fn, params, batch, config):
    out = batch_loss(logits_fn(batch.tokens), batch, config, 1.0, normalizer=batch.num_loss_tokens)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=float("inf"))
    return float(out.loss.detach()), float(norm), out.stats


@pytest.mark.parametrize("loss", ["grpo", "sft"])
@pytest.mark.parametrize("cls_name, overrides", [m[1:] for m in MODELS], ids=[m[0] for m in MODELS])
def test_loss_and_grad_norm_equal_the_transformers_models(tmp_path, loss, cls_name, overrides):
    """One optimizer step's loss and gradient (rlkube.core.training.losses on both models' logits) agree."""
    hf, path = write_model(tmp_path, cls_name, **overrides)
    hf.train()  # attention_dropout is 0: train mode computes the same function
    gpt = load(path)
    tokens = tokens_of(4, batch=6)
    old = None
    if loss == "grpo":
        # sampling log-probs near the current policy's, so that some ratios leave the clip range and some do not;
        # scaled by 0.9 so that the ratio (hence the loss) depends on the model's log-probs, not only on the noise
        with torch.no_grad():
            current = token_logprobs(hf(tokens).logits, tokens)
        noise = 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(6))
        old = torch.cat([torch.zeros(tokens.shape[0], 1), 0.9 * current + noise], dim=1)
    batch = collate(documents(old, tokens, seed=5))
    config = LossConfig(loss, 0.2, 0.2)
    want_loss, want_norm, want_stats = grad_step(lambda t: hf(t).logits, hf.parameters(), batch, config)
    got_loss, got_norm, got_stats = grad_step(gpt.logits, gpt.model.parameters(), batch, config)
    print(f"{cls_name} {overrides} {loss}: loss {want_loss:.6f} vs {got_loss:.6f} "
          f"(rel {abs(got_loss - want_loss) / abs(want_loss):.1e}); grad norm {want_norm:.6f} vs {got_norm:.6f} "
          f"(rel {abs(got_norm - want_norm) / want_norm:.1e}); clipped {got_stats.clipped:.0f}/{got_stats.tokens:.0f}")
    assert got_loss == pytest.approx(want_loss, rel=LOSS_RTOL)
    assert got_norm == pytest.approx(want_norm, rel=GRAD_NORM_RTOL)
    assert got_stats.tokens == want_stats.tokens and got_stats.clipped == want_stats.clipped
    if loss == "grpo":
        assert 0 < got_stats.clipped < got_stats.tokens  # the clipped branch is exercised, not everything
    grads = gpt.to_hf_names({n: p.grad for n, p in gpt.model.named_parameters()})
    want_grads = {n: p.grad for n, p in hf.named_parameters()}
    assert sorted(grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_unsupported_architectures_are_named(tmp_path):
    from rlkube.core.backends.megatron_hf import UnsupportedArchitecture
    from rlkube.core.hf.errors import ModelError
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).save_pretrained(gpt2)
    with pytest.raises(ModelError, match="GPT2LMHeadModel"):  # refused by the directory check, naming the field
        load(gpt2)
    _, path = write_model(tmp_path / "bias", "LlamaConfig", attention_bias=True)
    with pytest.raises(UnsupportedArchitecture, match="attention_bias"):  # loads in transformers, not mapped here
        load(path)


def test_activation_recomputation_gives_the_same_gradients(tmp_path):
    """Gradient checkpointing (megatron's full recompute, through the CPU shim's RNG-state functions)."""
    from rlkube.core.backends.megatron_gpt import MegatronGPT

    _, path = write_model(tmp_path, "Qwen2Config")
    tokens = tokens_of(7)
    grads = []
    for recompute in (False, True):
        gpt = MegatronGPT.from_hf_dir(path, recompute=recompute)
        assert gpt.model.config.recompute_granularity == ("full" if recompute else None)
        gpt.logits(tokens).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in gpt.model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("cls_name, overrides", [("LlamaConfig", {}), ("Qwen2Config", {"tie_word_embeddings": True})],
                         ids=["llama", "qwen2-tied"])
def test_chunked_logprobs_equal_the_full_logits(tmp_path, cls_name, overrides):
    """The loss's log-probs (MegatronGPT.token_logprobs: final hidden states, output layer 5 tokens at a time under
    checkpointing) equal losses.token_logprobs / token_entropy of the full logits, with the same gradients (1e-5)."""
    from rlkube.core.training.losses import token_entropy

    _, path = write_model(tmp_path, cls_name, **overrides)
    tokens = tokens_of(3)
    weights = torch.randn(tokens.shape[0], tokens.shape[1] - 1, generator=torch.Generator().manual_seed(1))
    results = []
    for chunked in (False, True):
        gpt = load(path)
        if chunked:
            logp, entropy = gpt.token_logprobs(tokens, 0.8, chunk_size=5)
        else:
            logits = gpt.logits(tokens)
            logp, entropy = token_logprobs(logits, tokens, 0.8), token_entropy(logits[:, :-1])
        (logp * weights).sum().backward()
        results.append((logp.detach(), entropy, {n: p.grad for n, p in gpt.model.named_parameters()}))
    (want_logp, want_entropy, want_grads), (got_logp, got_entropy, got_grads) = results
    torch.testing.assert_close(got_logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
