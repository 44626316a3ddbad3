"""Parameter names and layouts: megatron-core GPTModel <-> rlkube.core.model.TinyLM (pure torch, no megatron).

Why: the megatron backend trains a megatron-core GPTModel, but everything outside the trainer (the native
inference server, the weight-update wire format, checkpoints, a torch-backend trainer resuming one) speaks
TinyLM's state_dict. Converting at the edge keeps one format everywhere, so a megatron-trained checkpoint can be
served, and a torch checkpoint resumed by the megatron backend (weights AND Adam moments), and vice versa.

The two architectures are the same function (learned absolute positions, pre-LayerNorm blocks, multi-head
attention with a fused QKV projection with bias, a 4h GELU MLP, final LayerNorm, untied output layer without
bias); they differ in names and in one layout: megatron's `linear_qkv` rows are grouped per attention head
(for each head: its query, key and value rows), TinyLM's `qkv` rows are all queries, then all keys, then all
values. Moments of Adam have the shape of their parameter and are converted the same way.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

# TinyLM name pattern -> megatron name template ({i} = layer index)
_LAYER_NAMES = {
    "ln1.weight": "input_layernorm.weight",
    "ln1.bias": "input_layernorm.bias",
    "qkv.weight": "self_attention.linear_qkv.weight",
    "qkv.bias": "self_attention.linear_qkv.bias",
    "proj.weight": "self_attention.linear_proj.weight",
    "proj.bias": "self_attention.linear_proj.bias",
    "ln2.weight": "pre_mlp_layernorm.weight",
    "ln2.bias": "pre_mlp_layernorm.bias",
    "mlp.0.weight": "mlp.linear_fc1.weight",
    "mlp.0.bias": "mlp.linear_fc1.bias",
    "mlp.2.weight": "mlp.linear_fc2.weight",
    "mlp.2.bias": "mlp.linear_fc2.bias",
}
_GLOBAL_NAMES = {
    "embed.weight": "embedding.word_embeddings.weight",
    "pos.weight": "embedding.position_embeddings.weight",
    "ln_f.weight": "decoder.final_layernorm.weight",
    "ln_f.bias": "decoder.final_layernorm.bias",
    "head.weight": "output_layer.weight",
}
_LAYER_TO_TINY = {v: k for k, v in _LAYER_NAMES.items()}
_GLOBAL_TO_TINY = {v: k for k, v in _GLOBAL_NAMES.items()}
_TINY_LAYER = re.compile(r"^blocks\.(\d+)\.(.+)$")
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def megatron_name(tiny: str) -> str:
    """TinyLM parameter name -> megatron-core GPTModel's; an unknown name raises (no silent drop, 6.15)."""
    if tiny in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[tiny]
    m = _TINY_LAYER.match(tiny)
    if m and m.group(2) in _LAYER_NAMES:
        return f"decoder.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"TinyLM parameter {tiny!r} has no megatron-core counterpart")


def tiny_name(megatron: str) -> str:
    """megatron-core GPTModel parameter name -> TinyLM's; an unknown name raises."""
    if megatron in _GLOBAL_TO_TINY:
        return _GLOBAL_TO_TINY[megatron]
    m = _MEGATRON_LAYER.match(megatron)
    if m and m.group(2) in _LAYER_TO_TINY:
        return f"blocks.{m.group(1)}.{_LAYER_TO_TINY[m.group(2)]}"
    raise KeyError(f"megatron-core parameter {megatron!r} has no TinyLM counterpart")


def _regroup_qkv(t: torch.Tensor, heads: int, to_megatron: bool) -> torch.Tensor:
    rows = t.shape[0]
    if rows % (3 * heads):
        raise ValueError(f"QKV tensor of {rows} rows does not split into 3 x {heads} heads")
    head_dim = rows // (3 * heads)
    rest = tuple(t.shape[1:])
    outer = (3, heads) if to_megatron else (heads, 3)
    return t.reshape(*outer, head_dim, *rest).transpose(0, 1).reshape(rows, *rest).contiguous()


def _is_qkv(tiny: str) -> bool:
    return tiny.endswith((".qkv.weight", ".qkv.bias"))


def to_megatron(tiny: str, tensor: torch.Tensor, heads: int) -> tuple[str, torch.Tensor]:
    """One TinyLM tensor (a weight or an Adam moment of it) -> (megatron name, megatron layout)."""
    return megatron_name(tiny), megatron_layout(tiny, tensor, heads)


def to_tiny(megatron: str, tensor: torch.Tensor, heads: int) -> tuple[str, torch.Tensor]:
    """One megatron tensor -> (TinyLM name, TinyLM layout)."""
    return tiny_name(megatron), tiny_layout(megatron, tensor, heads)


def megatron_layout(tiny: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return _regroup_qkv(tensor, heads, to_megatron=True) if _is_qkv(tiny) else tensor


def tiny_layout(megatron: str, tensor: torch.Tensor, heads: int) -> torch.Tensor:
    return _regroup_qkv(tensor, heads, to_megatron=False) if _is_qkv(tiny_name(megatron)) else tensor


def convert_optimizer_state(
    state: dict, source_names: list[str], target_names: list[str],
    rename: Callable[[str], str], relayout: Callable[[str, torch.Tensor], torch.Tensor],
) -> dict:
    """Re-key a torch optimizer state_dict (one param group) from one model's parameter order to another's.

    `source_names[i]` is the parameter at position i of the state's group; `rename` maps a source name to the
    target's, `relayout(source_name, tensor)` a tensor of that parameter's shape (an Adam moment) to the
    target's layout. Scalars (Adam's `step`) pass unchanged. Names must correspond one to one.
    """
    groups = state["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"expected one optimizer param group, got {len(groups)}")
    ids = groups[0]["params"]
    if len(ids) != len(source_names):
        raise ValueError(f"optimizer state has {len(ids)} parameters, the model {len(source_names)}")
    index_of = {name: i for i, name in enumerate(target_names)}
    renamed = [rename(n) for n in source_names]
    if sorted(renamed) != sorted(target_names):
        raise ValueError("optimizer state: the two models' parameters do not correspond one to one")
    new_state = {}
    for source, target, param_id in zip(source_names, renamed, ids, strict=True):
        per_param = state["state"].get(param_id)
        if per_param is None:
            continue  # never stepped
        new_state[index_of[target]] = {
            key: relayout(source, value) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
            for key, value in per_param.items()
        }
    group = {k: v for k, v in groups[0].items() if k != "params"}
    group["params"] = list(range(len(target_names)))
    return {"state": new_state, "param_groups": [group]}
