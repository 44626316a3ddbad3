"""The trainer role's weight publication with the real native inference server: both as subprocesses.

After training, the server's model version is the trainer's last step and its log-probs of a fixed completion
are those of the trainer's final checkpoint (and differ from the initial weights'), so every step's update went
over the weight-update group, in order, without a cast or a missing tensor.
"""

from __future__ import annotations

from core_roles import (
    add_documents,
    assert_serves_checkpoint,
    graceful_roles_fixture,  # noqa: F401  (fixture graceful_roles)
    keys_for,
    make_documents,
    read_events,
    start_trainer_and_inference,
    tiny_spec,
)
from rlkube.core import checkpoint as ckpt
from rlkube.core import protocol

START_TIMEOUT = 90


def test_inference_serves_the_trainers_final_weights(redis_client, redis_server, tmp_path, graceful_roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4, learningRate=0.01)
    keys = keys_for("sync", spec)
    trainer, url = start_trainer_and_inference(graceful_roles, tmp_path, "sync", spec, redis_server.url, START_TIMEOUT)
    add_documents(redis_client, keys, make_documents(12))
    assert trainer.wait(START_TIMEOUT) == 0, trainer.log()
    finished = read_events(redis_client, keys, protocol.TRAINING_FINISHED)[0]
    assert finished.payload["step"] == 3
    ready = read_events(redis_client, keys, protocol.WEIGHTS_READY)
    assert [e.payload["version"] for e in ready] == [0, 1, 2, 3] and all(e.payload.get("epoch") for e in ready)
    assert_serves_checkpoint(url, spec, ckpt.Path(finished.payload["checkpoint"]), version=3, n=2)
