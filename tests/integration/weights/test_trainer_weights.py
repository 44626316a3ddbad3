"""The trainer role's weight publication with the real native inference server: both as subprocesses.

After training, the server's model version is the trainer's last step and its log-probs of a fixed completion
are those of the trainer's final checkpoint (and differ from the initial weights'), so every step's update went
over the weight-update group, in order, without a cast or a missing tensor.
"""

from __future__ import annotations

from support.core_roles import (
    assert_serves_checkpoint,
    graceful_roles_fixture,  # noqa: F401  (fixture graceful_roles)
    tiny_spec,
    train_with_inference,
)
from rlkube.core.training import checkpoint as ckpt

START_TIMEOUT = 90


def test_inference_serves_the_trainers_final_weights(redis_client, redis_server, tmp_path, graceful_roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4, learningRate=0.01)
    _, url, finished = train_with_inference(graceful_roles, tmp_path, "sync", spec, redis_client, redis_server.url,
                                            START_TIMEOUT)
    assert_serves_checkpoint(url, spec, ckpt.Path(finished.payload["checkpoint"]), version=3, n=2)
