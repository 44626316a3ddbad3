"""TinyLM <-> megatron-core names and layouts (pure torch; runs without megatron-core installed)."""

import pytest
import torch
from rlkube.core.backends.megatron_layout import (
    convert_optimizer_state,
    megatron_layout,
    megatron_name,
    tiny_layout,
    tiny_name,
    to_megatron,
    to_tiny,
)
from rlkube.core.model import TinyConfig, TinyLM


def test_every_tinylm_parameter_has_a_megatron_name_and_back():
    names = list(TinyLM(TinyConfig(vocab_size=10, layers=2, hidden_size=8, heads=2)).state_dict())
    assert megatron_name("blocks.1.qkv.weight") == "decoder.layers.1.self_attention.linear_qkv.weight"
    assert megatron_name("blocks.0.mlp.2.bias") == "decoder.layers.0.mlp.linear_fc2.bias"
    assert megatron_name("head.weight") == "output_layer.weight"
    assert [tiny_name(megatron_name(n)) for n in names] == names
    assert len({megatron_name(n) for n in names}) == len(names)
    with pytest.raises(KeyError, match="blocks.0.lora.weight"):
        megatron_name("blocks.0.lora.weight")
    with pytest.raises(KeyError, match="decoder.layers.0.self_attention.q_layernorm.weight"):
        tiny_name("decoder.layers.0.self_attention.q_layernorm.weight")


def test_qkv_rows_are_regrouped_per_head_by_hand():
    # 2 heads, head_dim 1: TinyLM rows [q0 q1 k0 k1 v0 v1] -> megatron rows [q0 k0 v0 q1 k1 v1]
    rows = torch.tensor([10.0, 11.0, 20.0, 21.0, 30.0, 31.0])
    assert megatron_layout("blocks.0.qkv.bias", rows, heads=2).tolist() == [10, 20, 30, 11, 21, 31]
    # head_dim 2, weight of 2 columns: each head moves its block of 2 rows
    w = torch.arange(12 * 2, dtype=torch.float32).reshape(12, 2)
    name, m = to_megatron("blocks.3.qkv.weight", w, heads=2)
    assert name == "decoder.layers.3.self_attention.linear_qkv.weight"
    q, k, v = w[0:4], w[4:8], w[8:12]
    expected = torch.cat([q[0:2], k[0:2], v[0:2], q[2:4], k[2:4], v[2:4]])
    assert torch.equal(m, expected)
    back_name, back = to_tiny(name, m, heads=2)
    assert back_name == "blocks.3.qkv.weight" and torch.equal(back, w)
    # every other tensor is only renamed
    x = torch.randn(4, 3)
    assert torch.equal(tiny_layout("decoder.layers.0.mlp.linear_fc1.weight", x, heads=2), x)
    with pytest.raises(ValueError, match="3 x 4 heads"):
        megatron_layout("blocks.0.qkv.bias", torch.zeros(9), heads=4)


def test_optimizer_state_is_reordered_and_regrouped():
    names = ["embed.weight", "blocks.0.qkv.bias", "head.weight"]
    target = [megatron_name(n) for n in reversed(names)]
    qkv_moment = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 2)},
                  1: {"step": torch.tensor(3.0), "exp_avg": qkv_moment, "exp_avg_sq": qkv_moment * 2}},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
    }
    out = convert_optimizer_state(state, names, target, megatron_name,
                                  lambda n, t: megatron_layout(n, t, heads=2))
    assert out["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2]}]
    assert set(out["state"]) == {2, 1}  # embed -> index 2, qkv -> index 1; head never stepped
    assert out["state"][1]["exp_avg"].tolist() == [1, 3, 5, 2, 4, 6]
    assert out["state"][1]["exp_avg_sq"].tolist() == [2, 6, 10, 4, 8, 12]
    assert out["state"][1]["step"] == 3.0
    back = convert_optimizer_state(out, target, names, tiny_name, lambda n, t: tiny_layout(n, t, heads=2))
    assert torch.equal(back["state"][1]["exp_avg"], qkv_moment) and set(back["state"]) == {0, 1}
    with pytest.raises(ValueError, match="one to one"):
        convert_optimizer_state(state, names, target[:2] + ["output_layer.bias"], megatron_name, lambda n, t: t)
