"""Hugging Face causal LMs <-> megatron-core GPTModel: the architecture translation and the weight mapping.

Why this module exists: the megatron backend trains a megatron-core GPTModel, but the job's model, its checkpoints
and the weights published to inference are Hugging Face directories and Hugging Face parameter names
(docs/design.md §5.6). This module turns a transformers config into GPTModel's arguments and converts tensors
(weights, and Adam moments, which have their parameter's shape) both ways. It is pure: no megatron import, no I/O.

Why not a maintained bridge (both were tried first, against megatron-core 0.16.1, Python 3.11, CPU):
- Megatron-Bridge 0.3.1 (the last release for Python 3.11) requires transformer-engine[core_cu13], mamba-ssm,
  causal-conv1d and nvidia-resiliency-ext (CUDA builds) and transformers<5, and `import megatron.bridge` imports
  transformer_engine unconditionally: it cannot be installed or imported on a CPU machine next to transformers 5.
- mbridge 0.15.1 (megatron-core>=0.12, pure Python) installs, but its LLM bridges build the Transformer Engine
  layer spec unconditionally (`NameError: TENorm` without TE), name the fused TE layer norms
  (`linear_qkv.layer_norm_weight`) that the TE-less local spec does not have, move the model with `.cuda()`, and
  read `hf_config.rope_theta`, which transformers 5 no longer has (it is `rope_parameters["rope_theta"]`).
  Its main branch fixes the rope read but is unreleased and still TE-only.
So the mapping is written here, following mbridge's conventions (the same fused QKV and gate/up layouts), for
megatron's local layer spec, which runs on CPU and on GPU.

Layouts (megatron-core 0.16.1, tensor parallel 1):
- `linear_qkv` rows are grouped by key/value head: for each of the `num_query_groups` groups, its
  `heads // groups` query heads, then its key head, then its value head (each `head_dim` rows); the bias likewise.
  Hugging Face keeps `q_proj`, `k_proj`, `v_proj` apart.
- `linear_fc1` is [gate_proj; up_proj] stacked on rows (megatron's gated linear unit: act(first half) * second).
- the local spec keeps the layer norms as modules (`input_layernorm`, `pre_mlp_layernorm`), unlike TE's spec.
- tied embeddings: megatron has no `output_layer.weight` (it reuses `embedding.word_embeddings.weight`); the
  Hugging Face state_dict lists `lm_head.weight` as the same tensor, its safetensors files omit it.
Tensor parallel (megatron's local spec, no sequence parallelism): each rank holds a contiguous slice of the
tensor-parallel parameters along their `tp_dim`: rows (dim 0) of the column-parallel `linear_qkv` (whole key/value
groups, since the rows are grouped by group and the size divides the groups), `linear_fc1`, the vocabulary-parallel
embedding and the output layer; columns (dim 1) of the row-parallel `linear_proj` and `linear_fc2`; the norms are
replicated. `linear_fc1` is the exception to "contiguous": megatron splits the gated unit on every rank, so rank r
holds [gate_r; up_r] and the full tensor is not the ranks' slices stacked. `shard` and `unshard` convert.
RoPE: megatron's default `rotary_interleaved=False` is the rotate-half convention Hugging Face Llama/Qwen use.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# megatron's RotaryEmbedding._apply_scaling hard-codes these Llama 3.x constants; only the factor is a parameter
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedArchitecture(ValueError):
    """The Hugging Face config asks for something this mapping does not compute exactly."""


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings of a transformers config: `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (transformers 4)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    out = dict(getattr(hf_config, "rope_scaling", None) or {})
    out.setdefault("rope_type", out.get("type", "default"))
    out["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return out


@dataclass(frozen=True)
class Architecture:
    """What the weight mapping needs to know about a model."""

    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, hf_config: Any) -> Architecture:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitecture(
                f"model_type {model_type!r} is not supported by the megatron backend "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        if heads % kv_heads:
            raise UnsupportedArchitecture(f"{heads} attention heads do not split into {kv_heads} key/value heads")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise UnsupportedArchitecture(f"hidden_act {hf_config.hidden_act!r}: only silu (SwiGLU) is mapped")
        if getattr(hf_config, "mlp_bias", False):
            raise UnsupportedArchitecture("mlp_bias: megatron would add biases to every linear layer")
        if model_type == "llama" and getattr(hf_config, "attention_bias", False):
            # Llama's attention_bias also biases o_proj; megatron's add_qkv_bias biases only linear_qkv
            raise UnsupportedArchitecture("attention_bias on a Llama model (o_proj bias) is not mapped")
        if model_type == "qwen3" and getattr(hf_config, "attention_bias", False):
            raise UnsupportedArchitecture("attention_bias on a Qwen3 model (o_proj bias) is not mapped")
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedArchitecture("use_sliding_window: sliding-window attention is not mapped")
        if getattr(hf_config, "partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedArchitecture("partial_rotary_factor != 1 is not mapped")
        return cls(
            num_layers=hf_config.num_hidden_layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hf_config.hidden_size,
            tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
        )


def transformer_config_kwargs(hf_config: Any) -> dict[str, Any]:
    """megatron `TransformerConfig` fields computing the Hugging Face model's function (without dtype and the
    CPU/fusion switches, which the backend adds)."""
    arch = Architecture.of(hf_config)
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": arch.heads,
        "num_query_groups": arch.kv_heads,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_norm,
        "hidden_dropout": 0.0,  # Llama/Qwen have no residual dropout
        "attention_dropout": float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        "rotary_interleaved": False,  # rotate-half, as transformers' apply_rotary_pos_emb
    }


def gpt_model_kwargs(hf_config: Any) -> dict[str, Any]:
    """megatron `GPTModel` constructor arguments besides the config and the layer spec."""
    arch = Architecture.of(hf_config)
    rope = rope_parameters(hf_config)
    kwargs: dict[str, Any] = {
        "vocab_size": hf_config.vocab_size,
        "max_sequence_length": hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": rope["rope_theta"],
        "share_embeddings_and_output_weights": arch.tied,
        "parallel_output": False,  # `logits` gathers the full vocabulary; the loss asks for its shard (token_logprobs)
    }
    rope_type = rope.get("rope_type", "default")
    if rope_type == "llama3":
        differing = {k: rope.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(rope.get(k, v)) != v}
        if differing:
            raise UnsupportedArchitecture(f"llama3 RoPE scaling with {differing}: megatron-core 0.16.1 hard-codes "
                                          f"{_MEGATRON_LLAMA3_ROPE}")
        kwargs["rope_scaling"] = True
        kwargs["rope_scaling_factor"] = float(rope["factor"])
    elif rope_type != "default":
        raise UnsupportedArchitecture(f"RoPE type {rope_type!r} is not mapped (default and llama3 are)")
    return kwargs


# --- names ---

_GLOBAL = {
    "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
    "decoder.final_layernorm.weight": ["model.norm.weight"],
    "output_layer.weight": ["lm_head.weight"],
}
_LAYER = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"],
    "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
}
_MEGATRON_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def hf_names(megatron_name: str) -> list[str]:
    """The Hugging Face parameter(s) that one megatron-core parameter holds; an unknown name raises."""
    if megatron_name in _GLOBAL:
        return list(_GLOBAL[megatron_name])
    m = _MEGATRON_LAYER.match(megatron_name)
    if m and m.group(2) in _LAYER:
        return [f"model.layers.{m.group(1)}.{suffix}" for suffix in _LAYER[m.group(2)]]
    raise KeyError(f"megatron-core parameter {megatron_name!r} has no Hugging Face counterpart")


# --- layouts ---

def _qkv_to_megatron(arch: Architecture, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    per_group = arch.heads // arch.kv_heads
    rest = tuple(q.shape[1:])
    q = q.reshape(arch.kv_heads, per_group * arch.head_dim, *rest)
    k = k.reshape(arch.kv_heads, arch.head_dim, *rest)
    v = v.reshape(arch.kv_heads, arch.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _qkv_to_hf(arch: Architecture, qkv: torch.Tensor) -> list[torch.Tensor]:
    per_group = arch.heads // arch.kv_heads
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(arch.kv_heads, (per_group + 2) * arch.head_dim, *rest)
    q, k, v = grouped.split([per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
    # clone: with one key/value head the slices are contiguous views of one storage, which safetensors refuses
    return [t.reshape(-1, *rest).clone() for t in (q, k, v)]


def to_megatron(arch: Architecture, megatron_name: str, hf_tensors: list[torch.Tensor]) -> torch.Tensor:
    """The Hugging Face tensor(s) of `hf_names(megatron_name)`, in that order -> the megatron tensor."""
    if ".linear_qkv." in megatron_name:
        return _qkv_to_megatron(arch, *hf_tensors)
    if megatron_name.endswith("linear_fc1.weight"):
        return torch.cat(hf_tensors, dim=0)
    (tensor,) = hf_tensors
    return tensor


def to_hf(arch: Architecture, megatron_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One megatron tensor -> its Hugging Face (name, tensor) pairs (new tensors of their own for fused parameters,
    the same tensor otherwise)."""
    names = hf_names(megatron_name)
    if ".linear_qkv." in megatron_name:
        parts = _qkv_to_hf(arch, tensor)
    elif megatron_name.endswith("linear_fc1.weight"):
        parts = [p.clone() for p in tensor.chunk(2, dim=0)]  # independent tensors, as for the QKV
    else:
        parts = [tensor]
    return list(zip(names, parts, strict=True))


# --- tensor parallel ---

_TP_DIMS = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "self_attention.linear_qkv.weight": 0,
            "self_attention.linear_qkv.bias": 0, "mlp.linear_fc1.weight": 0,
            "self_attention.linear_proj.weight": 1, "mlp.linear_fc2.weight": 1}


def tp_dim(megatron_name: str) -> int | None:
    """The dimension a tensor-parallel parameter is split along; None for a replicated one (the norms)."""
    hf_names(megatron_name)  # an unknown name raises
    m = _MEGATRON_LAYER.match(megatron_name)
    return _TP_DIMS.get(m.group(2) if m else megatron_name)


def _gated(megatron_name: str) -> bool:
    return megatron_name.endswith("linear_fc1.weight")


def shard(megatron_name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank`'s part (of `size`) of a full (tensor parallel 1 layout) megatron tensor."""
    dim = tp_dim(megatron_name)
    if size == 1 or dim is None:
        return full
    if full.shape[dim] % (2 * size if _gated(megatron_name) else size):
        raise ValueError(f"{megatron_name}: dimension {dim} of {tuple(full.shape)} does not split into {size} ranks")
    if _gated(megatron_name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()


def unshard(megatron_name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: every tensor-parallel rank's part, in rank order -> the full tensor."""
    dim = tp_dim(megatron_name)
    if len(parts) == 1 or dim is None:
        return parts[0]
    if _gated(megatron_name):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=dim)


def hf_state_to_megatron(arch: Architecture, hf_state: Mapping[str, torch.Tensor],
                         megatron_names: list[str]) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict -> megatron tensors for `megatron_names`. Strict: a missing or an unexpected
    Hugging Face tensor raises. With tied embeddings `lm_head.weight` may be absent (safetensors files omit
    it); if present it must equal the embedding."""
    needed = {n for m in megatron_names for n in hf_names(m)}
    extra = set(hf_state) - needed
    if arch.tied and "lm_head.weight" in extra:
        extra.discard("lm_head.weight")
        if not torch.equal(hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")
    missing = needed - set(hf_state)
    if missing or extra:
        raise KeyError(f"Hugging Face weights do not match the model: missing {sorted(missing)}, "
                       f"unexpected {sorted(extra)}")
    return {m: to_megatron(arch, m, [hf_state[n] for n in hf_names(m)]) for m in megatron_names}


def megatron_state_to_hf(arch: Architecture, megatron_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron tensors -> Hugging Face names: what the model directory's safetensors hold, a tied embedding once
    (under `model.embed_tokens.weight`; transformers' state_dict also lists it as `lm_head.weight`)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in megatron_state.items():
        out.update(to_hf(arch, name, tensor))
    return out
