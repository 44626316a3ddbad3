"""A model's weights under their Hugging Face names, each tied weight ONCE (as save_pretrained writes them).

A model with tied embeddings (Qwen2-0.5B, Qwen3 small models, some Llamas) has one tensor under two names
(`model.embed_tokens.weight` and `lm_head.weight`). safetensors refuses shared tensors and sending it twice would
double the transfer, so checkpoints and the weight transfer carry it under the first name of the state_dict (the
one the checkpoint's safetensors hold, `model.embed_tokens.weight`), and loading puts it back under every alias.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: kept name} for state_dict entries that share their storage with an earlier entry."""
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in first and tensor.numel() > 0:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict (HF names, detached) without tied aliases."""
    aliases = tied_aliases(model)
    return {name: t.detach() for name, t in model.state_dict().items() if name not in aliases}


def load_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor], aliases: dict[str, str] | None = None
                 ) -> None:
    """Copy `state` (as `named_weights` gives it) into `model`, converting dtypes; strict: a missing or an
    unexpected name raises (RuntimeError, like load_state_dict)."""
    aliases = tied_aliases(model) if aliases is None else aliases
    full = dict(state)
    for alias, kept in aliases.items():
        if kept in full:
            full.setdefault(alias, full[kept])
    model.load_state_dict(full, strict=True)


def copy_into(targets: Mapping[str, torch.Tensor], stream: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.dtype]:
    """Copy each (HF name, tensor) of `stream` into `targets[name]` (as `named_weights` gives them: views of the
    model's parameters) as it comes, converting dtypes, so a streamed update needs no copy of its own -> the dtype
    each name arrived in. Strict like `load_weights`: an unknown name, a wrong shape or a missing name raises."""
    arrived: dict[str, torch.dtype] = {}
    with torch.no_grad():
        for name, tensor in stream:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"unexpected weight {name!r}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {list(tensor.shape)}, the model's {list(target.shape)}")
            target.copy_(tensor)
            arrived[name] = tensor.dtype
    missing = sorted(set(targets) - set(arrived))
    if missing:
        raise KeyError(f"weights missing from the update: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return arrived
