"""The chaos case in miniature with every real role: the trainer is killed -9 mid-run and restarted in place.

Trainer, native inference, preprocessor and actor run as real processes over real Redis. The restarted trainer
resumes from its checkpoint, opens a new weight-sync epoch and pushes the checkpoint's weights; the running
inference server switches to the new epoch, the actors lower their lag credit and keep producing, and the job
finishes with every role exiting 0 on training_finished and the server out of the weight-update group.
"""

from __future__ import annotations

import signal

from rlkube.contract import protocol
from support.serve_helpers import (
    PREFIX,
    RoleProcesses,
    free_port,
    http_json,
    http_status,
    job_spec,
    log_text,
    wait_for,
    write_config,
)

KEYS = protocol.StreamKeys(PREFIX)


def events(redis_client) -> list[protocol.TrainerEvent]:
    out = []
    for sid, fields in redis_client.xrange(KEYS.events):
        event = protocol.decode_event(sid, fields)
        if event is not None:
            out.append(event)
    return out


def test_trainer_killed_mid_run_resumes_and_serving_follows(tmp_path, redis_server, redis_client):
    spec = job_spec(maxSteps=40, groupSize=4, samplesPerStep=8, maxLag=1)
    spec["trainer"] = {"checkpoint": {"intervalSteps": 5}}
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
    checkpoints = str(tmp_path / "checkpoints")
    try:
        trainer = roles.start_role("trainer", RLKUBE_CHECKPOINT_DIR=checkpoints)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        inference = roles.start_role("inference", RLKUBE_PORT=str(port))
        wait_for(lambda: http_status(url + "/health") == 200, 60, "inference joined the trainer's group")
        preprocessor = roles.start_role("preprocessor")
        actor = roles.start_role("actor", RLKUBE_INFERENCE_URLS=url)

        def saved():
            return [e.step for e in events(redis_client) if e.type == protocol.CHECKPOINT_SAVED]

        wait_for(lambda: saved(), 90, "the first checkpoint")
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        killed_at = max(e.step or 0 for e in events(redis_client) if e.type == protocol.WEIGHTS_READY)
        resumed_from = max(saved())
        assert killed_at < 40, "the run finished before the kill; the test needs a longer run"

        restarted = roles.start_role("trainer", name="trainer-restarted", RLKUBE_CHECKPOINT_DIR=checkpoints)
        finished = wait_for(
            lambda: next((e for e in events(redis_client) if e.type == protocol.TRAINING_FINISHED), None), 180,
            "training_finished from the restarted trainer")
        assert finished.step == 40 and not finished.payload.get("interrupted")
        assert restarted.wait(timeout=60) == 0, log_text(restarted)
        assert actor.wait(timeout=30) == 0, log_text(actor)
        assert preprocessor.wait(timeout=30) == 0, log_text(preprocessor)

        ready = [e for e in events(redis_client) if e.type == protocol.WEIGHTS_READY]
        epochs = list(dict.fromkeys(e.payload["epoch"] for e in ready))
        assert len(epochs) == 2  # one per trainer process
        first_of_new = next(e for e in ready if e.payload["epoch"] == epochs[1])
        assert first_of_new.payload["version"] == resumed_from  # the checkpoint's weights are pushed first

        status, body = http_json(url + "/health")
        assert status == 200 and body["training_finished"] and body["epoch"] is None
        assert body["model_version"] == 40
        assert log_text(inference).count("joining weight-update epoch") == 2
        if killed_at > resumed_from:
            assert "lag credit lowered" in log_text(actor)
        inference.send_signal(signal.SIGTERM)
        assert inference.wait(timeout=30) == 0
    finally:
        roles.cleanup()
