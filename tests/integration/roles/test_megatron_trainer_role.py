"""The trainer ROLE on the megatron backend (`spec.trainer.backend: megatron`) with the native inference server,
both as subprocesses over real Redis and the gloo weight-update group (megatron tier).

The megatron-core GPTModel's weights reach the server under their Hugging Face names and layouts: after training,
the served log-probs of fixed completions are the final checkpoint's (and not the initial weights'), and the
checkpoint is the Hugging Face directory the torch backend writes.
"""

from __future__ import annotations

import pytest
from support.core_roles import (
    assert_serves_checkpoint,
    graceful_roles_fixture,  # noqa: F401  (fixture graceful_roles)
    keys_for,
    read_events,
    tiny_spec,
    train_with_inference,
)
from support.megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol

pytestmark = pytest.mark.megatron

START_TIMEOUT = 120  # two processes importing torch (and megatron-core) on a loaded 2-core machine


def test_megatron_trainer_weights_are_served_by_native_inference(redis_client, redis_server, tmp_path,
                                                                 graceful_roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4, learningRate=0.01)
    spec["trainer"]["backend"] = "megatron"
    trainer, url, finished = train_with_inference(graceful_roles, tmp_path, "meg", spec, redis_client,
                                                  redis_server.url, START_TIMEOUT)
    assert "Traceback" not in trainer.log(), trainer.log()
    assert finished.payload["interrupted"] is False
    assert [e.step for e in read_events(redis_client, keys_for("meg", spec), protocol.METRICS)] == [1, 2, 3]
    path = ckpt.Path(finished.payload["checkpoint"])
    assert ckpt.read_meta(path).extra == {"backend": "megatron"}
    # the checkpoint is a Hugging Face directory, and the server computes with exactly its weights
    assert_serves_checkpoint(url, spec, path, version=3, n=3)
