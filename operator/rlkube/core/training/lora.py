"""LoRA adapters (`spec.trainer.lora`, docs/design.md §6): the trainer's side with PEFT, the engine's side in plain
torch, and the adapter directory in PEFT's format.

Trainer: `wrap(model, lora)` puts PEFT's LoRA layers on the targeted Linear modules of the HF model
(`peft.get_peft_model`); only the adapter's A and B matrices train, the base stays frozen. Each adapted Linear
computes W0 x + scaling * B (A x), scaling = alpha / rank, with B initialised to zero, so a fresh adapter is the
base model exactly. PEFT draws each fresh lora_A at random; `wrap` draws it from `spec.model.seed` (on an RNG of
its own, so the process's RNG is untouched): the same spec starts from the same adapter, on every rank and in
every run.

Names: the adapter's tensors are named as PEFT's `get_peft_model_state_dict` names them and as its
adapter_model.safetensors stores them: `base_model.model.<HF module>.lora_A.weight` ([rank, in]) and
`...lora_B.weight` ([out, rank]) for the HF weight `<HF module>.weight` ([out, in]). The same names travel in an
adapter weight update (rlkube.core.weights.wire.AdapterUpdate), so an engine maps each pair to the weight it adapts
without PEFT: `merge_into` sets W = W0 + scaling * B @ A from its own base copy W0 (never from the weights it
serves, so updates never accumulate).

Checkpoints: an adapter directory (`adapter_config.json`, written by PEFT's LoraConfig, and
`adapter_model.safetensors`) that `PeftModel.from_pretrained(base, path)` loads; rlkube.core.training.checkpoint puts
the optimizer state and meta.json beside it. `read_adapter` refuses a directory whose adapter is missing, unreadable or
of another shape with a ConfigError naming the path: a resumed job must never train a fresh adapter in silence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rlkube.api.spec import LoraSpec
from rlkube.core.errors import ConfigError

FIELD = "spec.trainer.lora"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's CONFIG_NAME
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's SAFETENSORS_WEIGHTS_NAME
PREFIX = "base_model.model."  # what PEFT's saved names put before the HF module name
_A, _B = ".lora_A.weight", ".lora_B.weight"


def scaling(lora: LoraSpec) -> float:
    return float(lora.alpha) / lora.rank


def peft_config(lora: LoraSpec):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, lora: LoraSpec, seed: int = 0):
    """The HF model with LoRA layers on `lora.target_modules` (a PeftModel; `model` is changed in place); the fresh
    lora_A matrices are drawn from `seed` (module docstring)."""
    from peft import get_peft_model

    from rlkube.core.hf.state import tied_aliases

    tied = {n for pair in tied_aliases(model).items() for n in pair}
    try:
        # PEFT initialises lora_A on the CPU before moving it to the base layer's device, so the CPU RNG is the
        # one to fork and seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            wrapped = get_peft_model(model, peft_config(lora))
    except ValueError as exc:  # e.g. "Target modules {...} not found in the base model"
        raise ConfigError(f"{FIELD}.targetModules", str(exc)) from None
    if shared := sorted(tied & set(pairs(adapter_state(wrapped)))):
        # A tied weight is sent and saved once under its other name (rlkube.core.hf.state): its adapter could not
        # be merged into one of its two uses alone.
        raise ConfigError(f"{FIELD}.targetModules", f"{shared} share their tensor with another weight (tied "
                                                    "embeddings): leave them out of targetModules")
    return wrapped


def adapter_state(peft_model) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (module docstring), detached."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: the A and B matrices only, also where lm_head is adapted (the base is frozen)
    return {k: v.detach() for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}


def load_adapter_state(peft_model, state: Mapping[str, torch.Tensor]) -> None:
    """Copy `state` (as `adapter_state` gives it) into the adapter; strict: a missing, unexpected or misshaped
    tensor raises RuntimeError."""
    from peft import set_peft_model_state_dict

    own = adapter_state(peft_model)
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = [f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}" for k in own
              if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise RuntimeError(f"adapter state does not fit the model: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]}, shapes {shapes[:4]}")
    set_peft_model_state_dict(peft_model, dict(state))


def pairs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight name: (A, B)} of an adapter state; ValueError on a name that is not an A/B pair."""
    out: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in state.items():
        if not name.startswith(PREFIX) or not name.endswith((_A, _B)):
            raise ValueError(f"adapter tensor {name!r} is not {PREFIX}<module>{_A} or {_B}")
        module = name[len(PREFIX):-len(_A)]
        out.setdefault(module, [None, None])[0 if name.endswith(_A) else 1] = tensor
    missing = [m for m, ab in out.items() if ab[0] is None or ab[1] is None]
    if missing:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {missing[:4]}")
    return {f"{m}.weight": (a, b) for m, (a, b) in out.items()}


def delta(a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale * B @ A ([out, in]), computed in float32 (bf16 matmuls on CPU are slow and round twice)."""
    return (b.to(torch.float32) @ a.to(torch.float32) * scale).to(dtype)


@torch.no_grad()
def merge_into(model: torch.nn.Module, base: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
               scale: float) -> int:
    """Serve base + adapter: for every adapted weight set `model`'s W = base W0 + scale * B @ A (in float32, then
    the served dtype); the other weights are left as they are (the base's). Returns the number of weights set.
    KeyError/ValueError when the adapter names a weight the model lacks or of another shape."""
    params = dict(model.named_parameters())
    adapted = pairs(state)
    for name, (a, b) in adapted.items():
        if name not in params or name not in base:
            raise KeyError(f"the adapter adapts {name!r}, which the served model does not have")
        w, w0 = params[name], base[name]
        if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {name}: B {tuple(b.shape)} @ A {tuple(a.shape)} does not fit {tuple(w.shape)}")
        w.copy_((w0.to(torch.float32) + delta(a, b, scale)).to(w.dtype))
    return len(adapted)


@torch.no_grad()
def merged_weights(peft_model, hf_names: list[str]) -> list[tuple[str, torch.Tensor]]:
    """The full weights base + adapter under the base model's HF names (`hf_names`, as rlkube.core.hf.state's
    `named_weights` of the unwrapped model gives them), float32: what an engine that takes full weights (vLLM)
    serves. Adapted weights are new tensors; the others are the base's own (detached)."""
    base = peft_model.get_base_model()
    state = base.state_dict()
    adapted = pairs(adapter_state(peft_model))
    s = scaling_of(peft_model)
    out = []
    for name in hf_names:
        if name in adapted:
            module = name[: -len(".weight")]
            w0 = state[f"{module}.base_layer.weight"]
            a, b = adapted[name]
            out.append((name, (w0.to(torch.float32) + delta(a, b, s)).detach()))
        else:
            out.append((name, state[name].detach()))
    return out


def scaling_of(peft_model) -> float:
    cfg = peft_model.peft_config["default"]
    return float(cfg.lora_alpha) / (math.sqrt(cfg.r) if cfg.use_rslora else cfg.r)


def wire_config(lora: LoraSpec) -> dict[str, Any]:
    """What an adapter update's metadata says of the adapter (rlkube.core.weights.wire.AdapterUpdate)."""
    return {"format": "peft-lora", "rank": lora.rank, "alpha": float(lora.alpha), "scaling": scaling(lora),
            "target_modules": list(lora.target_modules)}


# --- the adapter directory ---


def write_adapter(directory: Path, peft_model, state: Mapping[str, torch.Tensor]) -> list[Path]:
    """PEFT's adapter directory: adapter_config.json (LoraConfig.save_pretrained) and adapter_model.safetensors."""
    from safetensors.torch import save_file

    directory = Path(directory)
    peft_model.peft_config["default"].save_pretrained(str(directory))
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(directory / ADAPTER_WEIGHTS_FILE),
              metadata={"format": "pt"})
    return [directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE]


def read_adapter(directory: Path, lora: LoraSpec) -> dict[str, torch.Tensor]:
    """The adapter tensors of a checkpoint directory, checked against `lora`; ConfigError (spec.trainer.lora, the
    path named) when the adapter is missing, unreadable or was trained with another rank or other modules."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG_FILE, directory / ADAPTER_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ConfigError(FIELD, f"the checkpoint's adapter {path} is missing: refusing to resume with a fresh "
                                     "adapter (restore the file, or remove the checkpoint directory to start over)")
    try:
        config = json.loads(config_path.read_text())
        rank, targets = int(config["r"]), config["target_modules"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(FIELD, f"the checkpoint's adapter config {config_path} is unreadable: {exc}") from None
    if rank != lora.rank or sorted(targets if isinstance(targets, list) else [targets]) != sorted(lora.target_modules):
        raise ConfigError(FIELD, f"the checkpoint's adapter {config_path} has rank {rank} on {targets}, the spec "
                                 f"asks for rank {lora.rank} on {list(lora.target_modules)}")
    try:
        return load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own errors on a torn or foreign file
        raise ConfigError(FIELD, f"the checkpoint's adapter {weights_path} is unreadable: {exc}") from None
