"""A role process's reading of its launcher's contract (rlkube.contract.runtime): the job and its spec.

The contract itself (the variable names, ports, exit codes) is written beside this module so that the launchers
can name it without importing a role; this module is the role side. The spec in the job config was validated
by whoever wrote it (the operator or `rlkube local`, rlkube.lifecycle.validation, before any child exists), so
a role only types it (`model_validate`) and never imports the validation rules: a config that does not even
type-check is a launcher/image version skew, reported as such.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract.protocol import StreamKeys
from rlkube.contract.runtime import (
    ENV_BIND_HOST,
    ENV_CHECKPOINT_DIR,
    ENV_CONFIG,
    ENV_INDEX,
    ENV_INFERENCE_URLS,
    ENV_MODEL_CACHE,
    ENV_OUTPUT_DIR,
    ENV_PORT,
    ENV_REDIS_PASSWORD,
    ENV_REDIS_URL,
    ENV_WEIGHT_SYNC,
    weight_sync_rank,
    weight_sync_world_size,
    with_password,
)


@dataclass(frozen=True)
class RoleContext:
    namespace: str
    job: str
    spec: TrainingJobSpec
    redis_url: str
    index: int = 0
    inference_urls: tuple[str, ...] = ()
    weight_sync_addr: str | None = None
    bind_host: str = "127.0.0.1"
    port: int | None = None
    checkpoint_dir: Path | None = None
    output_dir: Path | None = None
    model_cache_dir: Path | None = None  # None: rlkube.core.hf.source.default_cache_dir()
    uid: str | None = None  # the run: the TrainingJob's uid, or the id `rlkube local` drew (None: not given)

    @property
    def keys(self) -> StreamKeys:
        return StreamKeys.for_job(self.namespace, self.job, self.spec.trainer.backend)

    @property
    def weight_sync_world_size(self) -> int:
        return weight_sync_world_size(self.spec)

    def weight_sync_rank(self, tp_rank: int = 0) -> int:
        """This inference server's rank (its tensor-parallel worker `tp_rank`'s) in the weight-update group."""
        return weight_sync_rank(self.spec, self.index, tp_rank)

    @classmethod
    def from_env(cls, env: os._Environ | dict | None = None) -> RoleContext:
        env = os.environ if env is None else env
        path = env.get(ENV_CONFIG)
        if not path:
            raise SystemExit(f"{ENV_CONFIG} is not set: the launcher must pass the job config file")
        doc = json.loads(Path(path).read_text())
        redis_url = env.get(ENV_REDIS_URL)
        if not redis_url:
            raise SystemExit(f"{ENV_REDIS_URL} is not set")
        try:
            spec = TrainingJobSpec.model_validate(doc["spec"])
        except ValidationError as exc:
            raise SystemExit(f"{path}: the job config's spec does not type-check against this image's rlkube "
                             f"(a launcher and image of different versions?): {exc}") from None
        return cls(
            namespace=doc["namespace"],
            job=doc["name"],
            spec=spec,
            redis_url=with_password(redis_url, env.get(ENV_REDIS_PASSWORD)),
            index=int(env.get(ENV_INDEX, "0")),
            inference_urls=tuple(u for u in env.get(ENV_INFERENCE_URLS, "").split(",") if u),
            weight_sync_addr=env.get(ENV_WEIGHT_SYNC) or None,
            bind_host=env.get(ENV_BIND_HOST, "127.0.0.1"),
            port=int(env[ENV_PORT]) if env.get(ENV_PORT) else None,
            checkpoint_dir=Path(env[ENV_CHECKPOINT_DIR]) if env.get(ENV_CHECKPOINT_DIR) else None,
            output_dir=Path(env[ENV_OUTPUT_DIR]) if env.get(ENV_OUTPUT_DIR) else None,
            model_cache_dir=Path(env[ENV_MODEL_CACHE]) if env.get(ENV_MODEL_CACHE) else None,
            uid=str(doc["uid"]) if doc.get("uid") else None,
        )
