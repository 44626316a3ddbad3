"""Loading a Hugging Face model directory with transformers (never remote code), and the checks that turn a
directory that cannot work into a `ModelError` naming `spec.model.path` before any role starts its loop.

Supported architectures: the decoder-only families whose HF implementation, weight names and vLLM support we rely
on (Llama, Qwen2, Qwen3). Another architecture may well load, but its weight names, tied embeddings and vLLM
mapping are untested, so it is refused with a message that says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkube.core.hf.errors import ModelError
from rlkube.core.hf.tokenizer import Tokenizer

FIELD = "spec.model.path"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
if TYPE_CHECKING:
    import torch
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def __getattr__(name: str) -> Any:
    # torch is imported on first use of DTYPES (or load_model), not with this module: checking a directory
    # (`rlkube local` before it starts the roles, materialize_model) should not pay seconds for importing torch.
    if name == "DTYPES":
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _quiet_transformers() -> None:
    """No progress bars ("Loading weights") in role logs."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def check_model_dir(directory: Path, field: str = FIELD) -> dict[str, Any]:
    """The directory's config.json as a dict, after checking everything that can be checked without loading it:
    it exists, is readable, holds config.json with a supported architecture and safetensors weights."""
    directory = Path(directory)
    if not directory.exists():
        raise ModelError(field, f"{directory} does not exist")
    if not directory.is_dir():
        raise ModelError(field, f"{directory} is not a directory")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ModelError(field, f"{directory} is not readable")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelError(field, f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        config = json.loads(config_path.read_text())
    except PermissionError:
        raise ModelError(field, f"{config_path} is not readable") from None
    except (OSError, ValueError) as exc:
        raise ModelError(field, f"{config_path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(field, f"{config_path} is not a JSON object")
    architectures = config.get("architectures") or []
    arch = architectures[0] if isinstance(architectures, list) and architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(field, f"architecture {arch!r} of {directory} is not supported "
                                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise ModelError(field, f"{directory} has no safetensors weights ({' or '.join(WEIGHT_FILES)})")
    return config


def load_config(directory: Path, field: str = FIELD):
    """The transformers config (a PretrainedConfig) of a checked directory."""
    from transformers import AutoConfig

    check_model_dir(directory, field)
    try:
        return AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad config
        raise ModelError(field, f"cannot read the config of {directory}: {type(exc).__name__}: {exc}") from None


def load_tokenizer(directory: Path, config=None, field: str = FIELD) -> Tokenizer:
    """The directory's tokenizer, checked against the model (`config`: its PretrainedConfig, loaded if None)."""
    tokenizer = Tokenizer.load(directory)
    check_tokenizer(config if config is not None else load_config(directory, field), tokenizer, directory, field)
    return tokenizer


def check_tokenizer(config, tokenizer: Tokenizer, directory: Path | str = "", field: str = FIELD) -> None:
    """The tokenizer belongs to the model: every id it can produce has an embedding row, and it has an end-of-
    sequence token (generation could never stop otherwise) whose id, like every special token's, is in range."""
    rows = int(config.vocab_size)
    where = f" of {directory}" if directory else ""
    if tokenizer.vocab_size > rows:
        raise ModelError(field, f"the tokenizer{where} has {tokenizer.vocab_size} tokens but the model's embedding "
                                f"has {rows} rows: tokenizer and model do not match")
    if not tokenizer.eos_ids:
        raise ModelError(field, f"the tokenizer{where} has no end-of-sequence token (eos_token)")
    specials = {"eos": list(tokenizer.eos_ids), "bos": [tokenizer.bos_id], "pad": [tokenizer.pad_id]}
    for name, ids in specials.items():
        bad = [i for i in ids if i is not None and not 0 <= int(i) < rows]
        if bad:
            raise ModelError(field, f"the tokenizer{where} has {name} token id {bad[0]} outside the model's "
                                    f"{rows} embedding rows: tokenizer and model do not match")


def check_sequence_length(config, max_sequence_length: int, field: str = "spec.model.maxSequenceLength") -> None:
    """The job's token limit fits the model's position range (beyond it RoPE models extrapolate badly)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max_sequence_length > int(limit):
        raise ModelError(field, f"{max_sequence_length} exceeds the model's max_position_embeddings ({limit})")


def load_model(directory: Path, dtype: torch.dtype | str = "float32", device: str | torch.device = "cpu",
               field: str = FIELD):
    """AutoModelForCausalLM from the directory (checked first), in `dtype`, on `device`, in eval mode."""
    from transformers import AutoModelForCausalLM

    check_model_dir(directory, field)
    _quiet_transformers()
    dtype = __getattr__("DTYPES")[dtype] if isinstance(dtype, str) else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, trust_remote_code=False,
                                                     attn_implementation="sdpa")
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for bad weights
        raise ModelError(field, f"cannot load the model of {directory}: {type(exc).__name__}: {exc}") from None
    return model.to(device).eval()
