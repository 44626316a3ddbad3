"""Training backends behind one interface (docs/design.md §6), chosen by `spec.trainer.backend`.

Every backend starts from the job's Hugging Face model directory and speaks Hugging Face names and layouts in
its weights and checkpoints (the contract is written down in `base.py`). `torch` trains AutoModelForCausalLM
with plain torch. `megatron` trains a megatron-core GPTModel of the same architecture (module `megatron_backend`,
importable only where the `megatron` extra is installed; on CPU through the shim in `megatron_cpu`); both read
and write the same checkpoints and publish the same weights.
`fast-llm` is never run by our trainer role: the trainer pod runs Fast-LLM itself and we only speak its Redis
protocol. Asking for a backend that is not available raises `BackendUnavailable` naming the field.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from rlkube.api.spec import TrainingJobSpec
from rlkube.core.backends.base import TrainerBackend


class BackendUnavailable(RuntimeError):
    pass


# backend name -> "module:class"; imported only when selected so that `torch` never imports megatron.
_BACKENDS = {
    "torch": "rlkube.core.backends.torch_backend:TorchBackend",
    "megatron": "rlkube.core.backends.megatron_backend:MegatronBackend",
}


def build_backend(spec: TrainingJobSpec, model_dir: Path, device: str = "cpu") -> TrainerBackend:
    """The backend `spec.trainer.backend`, loaded from `model_dir` (the materialized model directory)."""
    name = spec.trainer.backend
    if name == "fast-llm":
        raise BackendUnavailable(
            "spec.trainer.backend 'fast-llm': the trainer pod runs Fast-LLM itself (image trainer-fast-llm); "
            "`python -m rlkube.core.trainer` implements the torch and megatron backends"
        )
    target = _BACKENDS.get(name)
    if target is None:
        raise BackendUnavailable(f"spec.trainer.backend {name!r} is unknown (known: torch, megatron, fast-llm)")
    if spec.trainer.sharding == "fsdp":
        if name != "torch":
            raise BackendUnavailable(f"spec.trainer.sharding 'fsdp' is for backend torch, not {name!r}")
        target = "rlkube.core.backends.torch_fsdp:FSDPTorchBackend"
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(
            f"spec.trainer.backend {name!r} is not available in this image ({exc}); use backend 'torch' "
            f"or the image built for {name}"
        ) from None
    return getattr(module, cls_name)(spec, Path(model_dir), device=device)


__all__ = ["BackendUnavailable", "TrainerBackend", "build_backend"]
