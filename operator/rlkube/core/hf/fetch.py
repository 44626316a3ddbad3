"""`python -m rlkube.core.hf.fetch`: materialize the job's model before its roles start (the operator's model init
container; `rlkube local` may call `fetch()` itself).

It reads the job config the role will read (runtime.ENV_CONFIG) and runs `materialize_model(spec.model)` into the
model cache (runtime.ENV_MODEL_CACHE): an `hf://` repository is downloaded once (HF_TOKEN, HF_ENDPOINT and proxy
variables apply as usual), `builtin://` is written from the seed, a directory is checked. Then it checks what can be
checked without loading the weights, so a model that cannot work fails here, before any role runs: the config
loads, the tokenizer matches the model's embedding, and every safetensors file has a readable header.

A model that cannot work is a `ModelError` (a ConfigError naming `spec.model.path`): the process writes it to its
termination log and exits runtime.EXIT_CONFIG through `run_role`, as the roles do, and the job fails at once with
that message (rlkube.lifecycle.policies.config_error).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import runtime
from rlkube.core import errors
from rlkube.core.hf.errors import ModelError
from rlkube.core.hf.loading import load_config, load_tokenizer
from rlkube.core.hf.source import FIELD, default_cache_dir, materialize_model

log = logging.getLogger("rlkube.core.hf.fetch")


def check_weight_headers(directory: Path, field: str = FIELD) -> int:
    """Each safetensors file's header parses (a truncated or garbage file fails here, not in the roles); the count."""
    from safetensors import safe_open

    files = sorted(Path(directory).glob("*.safetensors"))
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as fh:
                fh.keys()
        except PermissionError:
            raise ModelError(field, f"{path} is not readable") from None
        except Exception as exc:  # noqa: BLE001 - safetensors raises SafetensorError, OSError, ...
            raise ModelError(field, f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    return len(files)


def fetch(spec, cache_dir: Path | None = None) -> Path:
    """The job's model directory, materialized and checked (config, tokenizer against the model, weight headers)."""
    path = materialize_model(spec.model, cache_dir)
    config = load_config(path)
    load_tokenizer(path, config)
    shards = check_weight_headers(path)
    log.info("model %s ready at %s (%s, %d safetensors file(s))", spec.model.path, path,
             (config.architectures or ["?"])[0], shards)
    return path


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s model-fetch %(levelname)s %(message)s")
    doc = json.loads(Path(os.environ[runtime.ENV_CONFIG]).read_text())
    fetch(TrainingJobSpec.model_validate(doc["spec"]), default_cache_dir())  # validated by its writer
    return 0


if __name__ == "__main__":
    sys.exit(errors.run_role(main))
