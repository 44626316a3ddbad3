"""A model that cannot work stops the role at start with a message naming the field: the trainer and the native
inference server, as real processes, exit runtime.EXIT_CONFIG and write the ModelError to their termination log
(what the operator and `rlkube local` put in the job's Failed condition); they touch nothing in Redis."""

from __future__ import annotations

import json

import pytest
from support.core_roles import (
    keys_for,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_role,
    tiny_spec,
)
from support.hf_models import write_tiny_model
from rlkube.contract import runtime


def unsupported(tmp_path):
    d = write_tiny_model(tmp_path / "gpt2", "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d, "architecture 'GPT2LMHeadModel'"


def missing(tmp_path):
    return tmp_path / "nowhere", "does not exist"


@pytest.mark.parametrize("role", ["trainer", "inference"])
@pytest.mark.parametrize("make", [missing, unsupported])
def test_bad_model_exits_with_a_termination_message_naming_the_field(redis_client, redis_server, tmp_path, roles,
                                                                     role, make):
    path, says = make(tmp_path)
    spec = tiny_spec()
    spec["model"]["path"] = str(path)
    log = tmp_path / f"{role}.termination-log"
    env = {runtime.ENV_TERMINATION_LOG: str(log), runtime.ENV_WEIGHT_SYNC: "127.0.0.1:1",
           runtime.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt")}
    proc = start_role(roles, role, tmp_path, "bad", spec, redis_server.url, **env)
    assert proc.wait(120) == runtime.EXIT_CONFIG, proc.log()
    message = log.read_text()
    assert message.startswith("spec.model.path: ") and says in message and str(path) in message, message
    assert redis_client.xlen(keys_for("bad", spec).events) == 0  # nothing announced, nothing to clean up
