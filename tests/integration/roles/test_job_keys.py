"""Every Redis key a job's roles create is named by `protocol.StreamKeys.all()`.

That list is what the operator deletes from an EXTERNAL Redis at teardown (rlkube.controller.decisions.stopping), so a
key missing from it would be left behind in the user's Redis after every job. The test runs a short job with
every real role (trainer, inference, two preprocessor replicas, actor) and then looks at what is in Redis.
"""

from __future__ import annotations

import signal

import redis
from rlkube.contract import protocol
from support.serve_helpers import (
    PREFIX, RoleProcesses, free_port, http_status, job_spec, log_text, wait_for, write_config,
)

KEYS = protocol.StreamKeys(PREFIX)


def finished(redis_client) -> protocol.TrainerEvent | None:
    for sid, fields in redis_client.xrange(KEYS.events):
        event = protocol.decode_event(sid, fields)
        if event is not None and event.type == protocol.TRAINING_FINISHED:
            return event
    return None


def consumers(redis_client) -> set[str]:
    """The rollouts consumer group's consumers (none before a preprocessor created the group)."""
    try:
        return {c["name"].decode() for c in redis_client.xinfo_consumers(KEYS.rollouts, protocol.ROLLOUTS_GROUP)}
    except redis.ResponseError:
        return set()


def test_a_job_leaves_only_keys_that_stream_keys_names(tmp_path, redis_server, redis_client):
    spec = job_spec(maxSteps=3, groupSize=4, samplesPerStep=8, maxLag=1)
    spec["preprocessor"] = {"replicas": 2}
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
    try:
        trainer = roles.start_role("trainer", RLKUBE_CHECKPOINT_DIR=str(tmp_path / "checkpoints"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        inference = roles.start_role("inference", RLKUBE_PORT=str(port))
        wait_for(lambda: http_status(url + "/health") == 200, 90, "inference joined the trainer's group")
        preprocessors = [roles.start_role("preprocessor", name=f"preprocessor-{i}", RLKUBE_INDEX=str(i))
                         for i in range(2)]
        # Both replicas in the consumer group before any rollout: a 3-step job can finish before a replica that
        # starts slowly (CI, two busy cores) ever reads, and it then exits without joining.
        wait_for(lambda: consumers(redis_client) == {"preprocessor-0", "preprocessor-1"}, 90,
                   "both preprocessors reading rollouts")
        actor = roles.start_role("actor", RLKUBE_INFERENCE_URLS=url)
        event = wait_for(lambda: finished(redis_client), 180, "training_finished")
        assert event.step == 3
        for proc in [trainer, actor, *preprocessors]:
            assert proc.wait(timeout=60) == 0, log_text(proc)
        inference.send_signal(signal.SIGTERM)  # it serves on after training_finished until stopped
        assert inference.wait(timeout=30) == 0, log_text(inference)
    finally:
        roles.cleanup()

    present = {k.decode() for k in redis_client.scan_iter(count=1000)}
    # the job really ran: its streams and the actors' lag counters are there
    assert {KEYS.events, KEYS.documents, KEYS.rollouts, KEYS.actor_samples_reserved, KEYS.actor_samples_written} \
        <= present
    assert present <= set(KEYS.all()), f"keys not in StreamKeys.all(): {sorted(present - set(KEYS.all()))}"
    # both preprocessor replicas read through the one consumer group
    assert consumers(redis_client) == {"preprocessor-0", "preprocessor-1"}
    # what the operator does at teardown of an external Redis leaves nothing behind
    redis_client.delete(*KEYS.all())
    assert redis_client.dbsize() == 0
