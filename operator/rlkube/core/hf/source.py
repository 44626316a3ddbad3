"""`materialize_model(spec.model, cache_dir)`: the ready Hugging Face directory for `spec.model.path`.

Every role calls it at start (and `rlkube local` / the operator's init container before the roles start, so the
roles find it ready):
- a directory: checked (exists, readable, config.json of a supported architecture, safetensors) and returned;
- `hf://org/name[@revision]`: huggingface_hub.snapshot_download into `cache_dir/hub` (the Hub's own cache layout,
  `models--org--name/{refs,snapshots/<commit>}`), only the files a model needs (json, safetensors, tokenizer
  files, chat template). With HF_HUB_OFFLINE=1 nothing is asked of the network and the cached snapshot is used
  (HF_TOKEN, HF_ENDPOINT work as usual);
- `builtin://tiny-llama`: written once into `cache_dir/builtin/tiny-llama-seed{seed}-v{format}` from the seed, into
  a temporary directory renamed into place, so concurrent roles never see a partial directory and all of them end
  up with the same bytes.
Errors are `ModelError`s naming `spec.model.path`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from rlkube.api.model_path import parse_model_path
from rlkube.api.spec import ModelSpec
from rlkube.contract.runtime import ENV_MODEL_CACHE
from rlkube.core.hf.builtin import BUILTIN_WRITERS, FORMAT_VERSION
from rlkube.core.hf.errors import ModelError
from rlkube.core.hf.loading import check_model_dir

log = logging.getLogger(__name__)

FIELD = "spec.model.path"
DEFAULT_CACHE = Path("~/.cache/rlkube/models")
# What a model needs from a Hub repository (no *.bin, *.pt, ONNX, GGUF, original/ checkpoints, ...).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(ENV_MODEL_CACHE) or DEFAULT_CACHE).expanduser()


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def materialize_model(spec: ModelSpec, cache_dir: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The checked model directory for `spec` (fetching or writing it into `cache_dir` first when needed)."""
    env = os.environ if env is None else env
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir(env)
    try:
        where = parse_model_path(spec.path, FIELD)
    except ValueError as exc:
        raise ModelError(FIELD, str(exc).removeprefix(f"{FIELD}: ")) from None
    if where.kind == "builtin":
        path = write_builtin(where.location, spec.seed, cache)
    elif where.kind == "hf":
        path = download(where.location, where.revision, cache, offline=_truthy(env.get("HF_HUB_OFFLINE")))
    else:
        path = Path(where.location)
    check_model_dir(path, FIELD)
    return path


def builtin_dir(name: str, seed: int, cache: Path) -> Path:
    return Path(cache) / "builtin" / f"{name}-seed{seed}-v{FORMAT_VERSION}"


def write_builtin(name: str, seed: int, cache: Path) -> Path:
    """The built-in model's directory, written if it is not there yet (atomically: temp dir + rename)."""
    final = builtin_dir(name, seed, cache)
    if final.is_dir():
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as exc:
        raise ModelError(FIELD, f"cannot write the built-in model into the model cache {cache}: {exc}") from None
    try:
        BUILTIN_WRITERS[name](tmp, seed)
        check_model_dir(tmp, FIELD)  # never rename an incomplete directory into place for every role to find
        for child in tmp.iterdir():
            _fsync(child)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another role won the race: its directory holds the same bytes.
        else:
            log.info("wrote builtin://%s (seed %d) to %s", name, seed, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def download(repo_id: str, revision: str | None, cache: Path, offline: bool = False) -> Path:
    """snapshot_download of the model files into `cache/hub`; with `offline`, the cached snapshot only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"hf://{repo_id}" + (f"@{revision}" if revision else "")
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=str(Path(cache) / "hub"),
                                 allow_patterns=HUB_PATTERNS, local_files_only=offline)
    except RevisionNotFoundError:
        raise ModelError(FIELD, f"{name}: revision {revision!r} does not exist") from None
    except GatedRepoError:
        raise ModelError(FIELD, f"{name} is gated: set HF_TOKEN to a token with access") from None
    except RepositoryNotFoundError:
        raise ModelError(FIELD, f"{name}: no such repository (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError as exc:
        mode = "HF_HUB_OFFLINE is set and " if offline else ""
        raise ModelError(FIELD, f"{name}: {mode}no complete snapshot in the model cache {cache} ({exc})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelError(FIELD, f"{name}: download failed: {type(exc).__name__}: {exc}") from None
    return Path(path)
