"""Hugging Face <-> megatron-core names, layouts and config translation (pure torch: runs without megatron-core)."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from rlkube.core.backends.megatron_hf import (
    Architecture,
    UnsupportedArchitecture,
    gpt_model_kwargs,
    hf_names,
    hf_state_to_megatron,
    megatron_state_to_hf,
    rope_parameters,
    to_hf,
    to_megatron,
    transformer_config_kwargs,
)


def config(**overrides):
    fields = {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8,
              "head_dim": 2, "num_hidden_layers": 1, "intermediate_size": 6, "rms_norm_eps": 1e-6,
              "vocab_size": 10, "max_position_embeddings": 16, "hidden_act": "silu",
              "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_qkv_rows_are_grouped_per_key_value_head_by_hand():
    # 4 query heads, 2 key/value heads, head_dim 1: HF q [q0 q1 q2 q3], k [k0 k1], v [v0 v1]
    # megatron rows: group 0 = [q0 q1 k0 v0], group 1 = [q2 q3 k1 v1]
    arch = Architecture.of(config(head_dim=1, hidden_size=4))
    q, k, v = torch.tensor([10.0, 11, 12, 13]), torch.tensor([20.0, 21]), torch.tensor([30.0, 31])
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    fused = to_megatron(arch, name, [q, k, v])
    assert fused.tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = to_hf(arch, name, fused)
    assert [n for n, _ in back] == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    assert [t.tolist() for _, t in back] == [q.tolist(), k.tolist(), v.tolist()]


@pytest.mark.parametrize("kv_heads, per_group, head_dim, columns",
                         list(itertools.product([1, 2, 3], [1, 2, 4], [1, 3], [1, 5])))
def test_qkv_and_gate_up_round_trip_exactly(kv_heads, per_group, head_dim, columns):
    heads = kv_heads * per_group
    arch = Architecture.of(config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim))
    gen = torch.Generator().manual_seed(kv_heads * 100 + per_group * 10 + head_dim)
    q = torch.randn(heads * head_dim, columns, generator=gen)
    k, v = (torch.randn(kv_heads * head_dim, columns, generator=gen) for _ in range(2))
    name = "decoder.layers.2.self_attention.linear_qkv.weight"
    fused = to_megatron(arch, name, [q, k, v])
    assert fused.shape == ((heads + 2 * kv_heads) * head_dim, columns)
    # the first group's rows: its query heads, its key head, its value head
    group0 = fused[: (per_group + 2) * head_dim]
    assert torch.equal(group0, torch.cat([q[: per_group * head_dim], k[:head_dim], v[:head_dim]]))
    back = [t for _, t in to_hf(arch, name, fused)]
    assert all(torch.equal(a, b) for a, b in zip(back, [q, k, v], strict=True))
    gate, up = torch.randn(6, columns, generator=gen), torch.randn(6, columns, generator=gen)
    fc1 = to_megatron(arch, "decoder.layers.0.mlp.linear_fc1.weight", [gate, up])
    assert torch.equal(fc1, torch.cat([gate, up]))
    out = to_hf(arch, "decoder.layers.0.mlp.linear_fc1.weight", fc1)
    assert [n for n, _ in out] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(out[0][1], gate) and torch.equal(out[1][1], up)


def test_names():
    assert hf_names("decoder.layers.3.pre_mlp_layernorm.weight") == ["model.layers.3.post_attention_layernorm.weight"]
    assert hf_names("decoder.layers.0.self_attention.k_layernorm.weight") == ["model.layers.0.self_attn.k_norm.weight"]
    assert hf_names("output_layer.weight") == ["lm_head.weight"]
    with pytest.raises(KeyError, match="linear_qkv.layer_norm_weight"):
        hf_names("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight")  # TE spec's name: not ours


MEGATRON_NAMES = ["embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight",
                  "decoder.final_layernorm.weight"]


def test_tied_embeddings_state():
    arch = Architecture.of(config(tie_word_embeddings=True))
    embed = torch.randn(10, 8)
    hf = {"model.embed_tokens.weight": embed, "model.layers.0.input_layernorm.weight": torch.ones(8),
          "model.norm.weight": torch.ones(8)}
    meg = hf_state_to_megatron(arch, hf, MEGATRON_NAMES)  # safetensors files omit lm_head.weight
    assert meg["embedding.word_embeddings.weight"] is embed
    out = megatron_state_to_hf(arch, meg)
    assert list(out) == list(hf) and out["model.embed_tokens.weight"] is embed  # the tied embedding once
    hf_state_to_megatron(arch, {**hf, "lm_head.weight": embed.clone()}, MEGATRON_NAMES)
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        hf_state_to_megatron(arch, {**hf, "lm_head.weight": embed + 1}, MEGATRON_NAMES)
    with pytest.raises(KeyError, match=r"missing \['model.norm.weight'\], unexpected \['model.extra'\]"):
        hf_state_to_megatron(arch, {**{k: v for k, v in hf.items() if k != "model.norm.weight"},
                                    "model.extra": embed}, MEGATRON_NAMES)


def test_config_translation():
    kw = transformer_config_kwargs(config(model_type="qwen2"))
    assert kw["num_query_groups"] == 2 and kw["kv_channels"] == 2 and kw["ffn_hidden_size"] == 6
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is False and kw["qk_layernorm"] is False
    assert kw["normalization"] == "RMSNorm" and kw["gated_linear_unit"] and not kw["rotary_interleaved"]
    assert transformer_config_kwargs(config(model_type="qwen3"))["qk_layernorm"] is True
    g = gpt_model_kwargs(config(tie_word_embeddings=True))
    assert g["share_embeddings_and_output_weights"] and g["rotary_base"] == 1e4 and "rope_scaling" not in g
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    g = gpt_model_kwargs(config(rope_parameters=llama3))
    assert g["rope_scaling"] is True and g["rope_scaling_factor"] == 32.0
    with pytest.raises(UnsupportedArchitecture, match="high_freq_factor"):
        gpt_model_kwargs(config(rope_parameters={**llama3, "high_freq_factor": 2.0}))
    with pytest.raises(UnsupportedArchitecture, match="'yarn'"):
        gpt_model_kwargs(config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}))
    # transformers 4 spelling
    old = config(rope_theta=5e5, rope_scaling=None)
    del old.rope_parameters
    assert rope_parameters(old) == {"rope_type": "default", "rope_theta": 5e5}


@pytest.mark.parametrize("overrides, match", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"use_sliding_window": True, "model_type": "qwen2"}, "sliding"),
    ({"num_key_value_heads": 3}, "do not split"),
])
def test_unsupported_configs_raise_naming_the_field(overrides, match):
    with pytest.raises(UnsupportedArchitecture, match=match):
        Architecture.of(config(**overrides))



def test_tensor_parallel_shards_by_hand():
    from rlkube.core.backends.megatron_hf import shard, tp_dim

    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    full = torch.arange(8.0)[:, None]  # gate rows 0-3, up rows 4-7
    # megatron splits the gated unit on every rank: rank r holds [gate_r; up_r]
    assert shard(fc1, full, 0, 2).flatten().tolist() == [0, 1, 4, 5]
    assert shard(fc1, full, 1, 2).flatten().tolist() == [2, 3, 6, 7]
    proj = "decoder.layers.1.self_attention.linear_proj.weight"
    assert tp_dim(proj) == 1 and tp_dim("decoder.layers.0.mlp.linear_fc2.weight") == 1
    assert shard(proj, torch.arange(8.0).view(2, 4), 1, 2).tolist() == [[2, 3], [6, 7]]
    assert tp_dim("decoder.layers.0.input_layernorm.weight") is None  # replicated
    assert tp_dim("decoder.layers.0.self_attention.q_layernorm.weight") is None
    norm = torch.ones(4)
    assert shard("decoder.final_layernorm.weight", norm, 1, 2) is norm
    with pytest.raises(ValueError, match="does not split into 3 ranks"):
        shard(fc1, full, 0, 3)
    with pytest.raises(KeyError):
        tp_dim("decoder.layers.0.mlp.router.weight")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_shards_reassemble_every_parameter(tp):
    from rlkube.core.backends.megatron_hf import shard, unshard

    arch = Architecture.of(config(model_type="qwen2", num_attention_heads=8, num_key_value_heads=4, hidden_size=16,
                                  intermediate_size=8, vocab_size=12, tie_word_embeddings=True))
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    names += [f"decoder.layers.0.{s}" for s in ("input_layernorm.weight", "self_attention.linear_qkv.weight",
                                                 "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                                                 "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight",
                                                 "mlp.linear_fc2.weight")]
    gen = torch.Generator().manual_seed(0)
    shapes = {"embedding.word_embeddings.weight": (12, 16), "decoder.final_layernorm.weight": (16,),
              "input_layernorm.weight": (16,), "linear_qkv.weight": (32, 16), "linear_qkv.bias": (32,),
              "linear_proj.weight": (16, 16), "pre_mlp_layernorm.weight": (16,), "linear_fc1.weight": (16, 16),
              "linear_fc2.weight": (16, 8)}
    for name in names:
        shape = next(v for k, v in shapes.items() if name.endswith(k))
        full = torch.randn(shape, generator=gen)
        parts = [shard(name, full, r, tp) for r in range(tp)]
        assert torch.equal(unshard(name, parts), full), name
        # each rank's QKV rows are whole key/value groups: its heads' q, k, v as the HF layout splits them
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    q, k, v = (torch.randn(n * 2, 16, generator=gen) for n in (8, 4, 4))
    full = to_megatron(arch, qkv, [q, k, v])
    for r in range(tp):
        local = Architecture(**{**arch.__dict__, "heads": 8 // tp, "kv_heads": 4 // tp})
        q_r, k_r, v_r = (t for _, t in to_hf(local, qkv, shard(qkv, full, r, tp)))
        for got, whole in ((q_r, q), (k_r, k), (v_r, v)):
            assert torch.equal(got, whole.chunk(tp)[r])
