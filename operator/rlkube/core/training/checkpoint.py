"""Durable, atomic trainer checkpoints. `step-{N:06d}/` is a Hugging Face model directory (config.json,
model.safetensors or shards + index, generation config, tokenizer files, chat template) plus optimizer.pt
(optimizer and LR-schedule state) and meta.json, so `AutoModelForCausalLM.from_pretrained(path)` and vLLM load
any checkpoint directly, and the final one is the job's trained policy.

The weights are the trainer's float32 masters under their HF names (each tied weight once, as save_pretrained
writes them); config.json is the job's model config with `dtype` set to `spec.model.dtype`, so loaders that use
the config's dtype serve the precision the job trained in. Everything that is not weights (config, tokenizer,
generation config, chat template) is copied from the job's model directory, byte for byte except config.json.

Why this shape: the operator only declares a job Succeeded on a `training_finished` event that names a saved
checkpoint, and a restarted trainer resumes from the newest one, so a checkpoint directory must be either
complete or invisible. Each one is written into a hidden temp directory, every file and the directory are
fsynced, and only then is it renamed into place (rename is atomic on POSIX). `latest_checkpoint` scans for
complete directories (all files present, meta.json parses and agrees with the name), so a trainer killed
mid-write never resumes from a torn checkpoint. Old checkpoints are first renamed out of sight, then deleted.

A LoRA job's checkpoint (spec.trainer.lora) holds PEFT's adapter directory in place of the weights
(adapter_config.json + adapter_model.safetensors, written by rlkube.core.training.lora; `PeftModel.from_pretrained(base,
path)` loads it), the same optimizer.pt, meta.json (`extra.adapter`) and the model's config and tokenizer files.
Such a checkpoint is complete once its meta.json is there (the rename makes it appear whole); an adapter missing
from it later is not skipped as a torn write but fails the resume (rlkube.core.training.lora.read_adapter), so a job
never trains a fresh adapter in silence.

Loading copies the tensors into the live model and drops the loaded (possibly memory-mapped) tensors before
returning, so that pruning old checkpoint files later never removes a file that still backs a tensor
(docs/references.md §6.14).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file

log = logging.getLogger(__name__)
# save_torch_state_dict logs every save at INFO ("Model weights successfully saved to .tmp-..."): we log our own.
logging.getLogger("huggingface_hub.serialization._torch").setLevel(logging.WARNING)

MODEL_FILE = "model.safetensors"  # the weights of a model below MAX_SHARD_SIZE
INDEX_FILE = "model.safetensors.index.json"  # else: shards named by this index
CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"
REQUIRED_FILES = (OPTIMIZER_FILE, META_FILE)  # plus MODEL_FILE or INDEX_FILE
MAX_SHARD_SIZE = "5GB"
# Files of a model directory that a checkpoint does not copy: its own weights replace them.
_NOT_COPIED = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".h5", ".msgpack", ".gguf", ".onnx")
_NAME = re.compile(r"^step-(\d{6,})$")
DEFAULT_KEEP = 2


@dataclass
class CheckpointMeta:
    step: int
    documents_seen: int = 0
    weights_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step-{step:06d}"


def shards_name(step: int) -> str:
    """The directory of a sharded (FSDP) trainer's distributed checkpoint of `step`, next to `step-{N}`."""
    return f"shards-{step:06d}"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_out_of_sight(root: Path, path: Path) -> None:
    """Rename first (atomic: no scan ever sees a half-deleted checkpoint), then delete."""
    trash = root / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def copy_model_files(model_dir: Path, target: Path, dtype: str | None = None) -> list[Path]:
    """Copy the non-weight files of a HF model directory (config, tokenizer, generation config, chat template...)
    into `target`; config.json gets `dtype` when given. Returns the files written."""
    written = []
    for src in sorted(Path(model_dir).iterdir()):
        if not src.is_file() or src.name.startswith(".") or src.name.endswith(_NOT_COPIED):
            continue
        if src.name in (OPTIMIZER_FILE, META_FILE):  # a checkpoint used as the model directory
            continue
        dst = target / src.name
        if src.name == CONFIG_FILE and dtype is not None:
            config = json.loads(src.read_text())
            config["dtype"] = dtype
            config.pop("torch_dtype", None)  # transformers < 5 spelling; `dtype` replaces it
            dst.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(src, dst)
        written.append(dst)
    return written


def save_checkpoint(
    root: Path,
    meta: CheckpointMeta,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    keep: int = DEFAULT_KEEP,
    model_dir: Path | None = None,
    dtype: str | None = None,
    write_weights: Callable[[Path], Any] | None = None,
) -> Path:
    """Write `root/step-{meta.step:06d}` atomically and durably; prune to the newest `keep`. Returns its path.

    `model_state`: the weights under HF names; `model_dir`: the job's model directory whose config and tokenizer
    files make the checkpoint a loadable HF directory (config.json's dtype set to `dtype`). `write_weights(dir)`
    writes the weights instead of `model_state` (a LoRA adapter directory, rlkube.core.training.lora.write_adapter)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(meta.step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if model_dir is not None:
            copy_model_files(model_dir, tmp, dtype)
        if write_weights is not None:
            write_weights(tmp)
        else:
            save_torch_state_dict({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, tmp,
                                  max_shard_size=MAX_SHARD_SIZE, metadata={"format": "pt"})
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        # meta.json last: its presence is part of what "complete" means.
        (tmp / META_FILE).write_text(json.dumps(asdict(meta), indent=1))
        for child in tmp.iterdir():
            _fsync_file(child)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after a resume): replace the old copy as a whole
            _remove_out_of_sight(root, final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep)
    return final


def weight_files(path: Path) -> list[Path]:
    """The safetensors files holding a checkpoint's (or model directory's) weights; [] when incomplete."""
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        return [path / MODEL_FILE]
    index = path / INDEX_FILE
    if not index.is_file():
        return []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    files = [path / n for n in names]
    return files if files and all(f.is_file() for f in files) else []


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors (one file or shards)."""
    files = weight_files(path)
    if not files:
        raise ValueError(f"{path} has no complete safetensors weights ({MODEL_FILE} or {INDEX_FILE} and its shards)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def read_meta(path: Path) -> CheckpointMeta | None:
    """The meta of a COMPLETE checkpoint directory, else None (with the reason logged)."""
    path = Path(path)
    m = _NAME.match(path.name)
    if not m or not path.is_dir():
        return None
    missing = [n for n in REQUIRED_FILES if not (path / n).is_file()]
    if missing:
        log.warning("ignoring incomplete checkpoint %s: missing %s", path, ", ".join(missing))
        return None
    try:
        raw = json.loads((path / META_FILE).read_text())
        meta = CheckpointMeta(
            step=int(raw["step"]),
            documents_seen=int(raw.get("documents_seen", 0)),
            weights_version=int(raw.get("weights_version", raw["step"])),
            extra=dict(raw.get("extra", {})),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring checkpoint %s: unreadable %s (%s)", path, META_FILE, exc)
        return None
    if meta.step != int(m.group(1)):
        log.warning("ignoring checkpoint %s: its meta says step %d", path, meta.step)
        return None
    if not meta.extra.get("adapter") and not weight_files(path):  # an adapter's absence fails the resume instead
        log.warning("ignoring incomplete checkpoint %s: missing %s (or %s and its shards)", path, MODEL_FILE,
                    INDEX_FILE)
        return None
    return meta


def list_checkpoints(root: Path) -> list[tuple[CheckpointMeta, Path]]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        meta = read_meta(child)
        if meta is not None:
            found.append((meta, child))
    return sorted(found, key=lambda mp: mp[0].step)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def prune(root: Path, keep: int = DEFAULT_KEEP) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and leftovers of interrupted writes."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    removed = []
    for meta, path in list_checkpoints(root)[:-keep]:
        _remove_out_of_sight(root, path)
        removed.append(path)
        shards = root / shards_name(meta.step)
        if shards.is_dir():  # a sharded trainer's distributed checkpoint goes with its step
            _remove_out_of_sight(root, shards)
    for child in root.iterdir():
        if child.name.startswith((".tmp-", ".trash-")) and child.is_dir():
            # A crashed writer's temp dir; ours are already renamed or removed by now.
            shutil.rmtree(child, ignore_errors=True)
    return removed


def load_checkpoint_state(
    path: Path,
    apply: Callable[[dict[str, torch.Tensor], dict[str, Any] | None], None],
    with_optimizer: bool = True,
    read_weights: Callable[[Path], dict[str, torch.Tensor]] = load_weights,
) -> CheckpointMeta:
    """Read a complete checkpoint and hand (model state, optimizer state or None) to `apply`, which must copy
    what it keeps (a backend's `load_state`); the loaded tensors are dropped before returning. `read_weights`
    reads the model state (a LoRA checkpoint's adapter: rlkube.core.training.lora.read_adapter)."""
    path = Path(path)
    meta = read_meta(path)
    if meta is None:
        raise ValueError(f"{path} is not a complete checkpoint")
    state = read_weights(path)
    opt_state = None
    try:
        if with_optimizer:
            opt_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        apply(state, opt_state)
    finally:
        # load_file may hand back tensors backed by a mapping of the file; `apply` copied them, so drop them
        # now, before anything can prune this directory.
        del state, opt_state
        gc.collect()
    return meta


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> CheckpointMeta:
    """Restore `model` (strict: a missing or unexpected key raises) and `optimizer` from a complete checkpoint."""

    def apply(model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        model.load_state_dict(model_state, strict=True)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)

    return load_checkpoint_state(path, apply, with_optimizer=optimizer is not None)
