"""The native inference server as a real process, with real Redis and a real trainer-side weight publisher.

Covered: /health is 503 until weights arrived over the group and 200 after; after an update the server's
log-probs of a fixed prompt are those of the trainer's new weights (recomputed here) and differ from before;
generation goes on while the server waits in the first update; training_finished leaves the group and the server
keeps serving until SIGTERM (exit 0); a trainer killed -9 and restarted (new epoch) and an inference server
restarted mid-run both recover; engine vllm without vllm fails fast.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import threading
import time

import pytest
import torch
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol
from support.hf_models import initial_model
from rlkube.core.training.losses import token_logprobs
from rlkube.core.weights.group import WeightSender
from rlkube.core.weights.wire import checksums_match, weights_checksum
from support.serve_helpers import (
    PREFIX,
    RoleProcesses,
    free_port,
    http_json,
    http_status,
    http_stream,
    job_spec,
    log_text,
    publish,
    wait_for,
    write_config,
)
from support.weightsync_peer import model_weights

KEYS = protocol.StreamKeys(PREFIX)
PROMPT = "123:"


@pytest.fixture
def roles(tmp_path, redis_server, redis_client):
    procs = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, job_spec()))
    yield procs
    procs.cleanup()


def start_server(roles: RoleProcesses) -> tuple[str, object]:
    port = free_port()
    proc = roles.start_role("inference", RLKUBE_PORT=str(port), RLKUBE_INDEX="0")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: http_status(url + "/v1/models") == 200 or proc.poll() is not None, 60, "the server")
    finally:
        if proc.poll() is not None:
            raise AssertionError(f"inference exited with {proc.returncode}:\n{log_text(proc)}")
    return url, proc


def health(url: str) -> tuple[int, dict]:
    return http_json(url + "/health", timeout=5)


def complete(url: str, **body) -> dict:
    status, reply = http_json(url + "/v1/completions", {
        "model": "builtin://tiny-llama", "prompt": PROMPT, "n": 4, "max_tokens": 4, "temperature": 1.0,
        "logprobs": 0, "seed": 11, **body,
    })
    assert status == 200, reply
    return reply


def expected_logprobs(config, state: dict[str, torch.Tensor], choice: dict, temperature: float = 1.0) -> list:
    model = initial_model(parse_spec(json.loads(config.read_text())["spec"]).model, state)
    tokens = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
    with torch.no_grad():
        lp = token_logprobs(model(tokens).logits, tokens, temperature)[0]
    return lp[len(choice["prompt_token_ids"]) - 1:].tolist()


def wait_version(url: str, version: int, timeout: float = 30) -> dict:
    return wait_for(lambda: (h := health(url))[0] == 200 and h[1]["model_version"] == version and h[1], timeout,
                      f"model_version {version}")


def test_health_and_logprobs_follow_the_weight_updates(roles):
    url, _ = start_server(roles)
    status, body = health(url)
    assert status == 503 and body["epoch"] is None  # not joined: the trainer has not announced anything

    before = complete(url)
    assert before["model_version"] == 0
    for choice in before["choices"]:  # the initial weights are the trainer's (same seed)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            expected_logprobs(roles.config, model_weights(str(roles.config), 0), choice), abs=1e-4)

    trainer = roles.start_trainer(0)
    first = wait_version(url, 0)
    assert first["epoch"] and first["updates"] == 1
    publish(trainer, 1)
    served = wait_version(url, 1)

    after = complete(url)
    assert after["model_version"] == 1
    new_state, old_state = model_weights(str(roles.config), 1), model_weights(str(roles.config), 0)
    moved = 0.0
    for choice in after["choices"]:
        got = choice["logprobs"]["token_logprobs"]
        assert len(choice["token_ids"]) == len(got) >= 1
        assert len(got) == 4 or choice["finish_reason"] == "stop"
        assert got == pytest.approx(expected_logprobs(roles.config, new_state, choice), abs=1e-4)
        old = expected_logprobs(roles.config, old_state, choice)
        moved = max(moved, max(abs(a - b) for a, b in zip(got, old, strict=True)))
    assert moved > 0.1, "the update did not change the served distribution"
    # the server reports the checksum of what it serves: the trainer's weights of version 1, not version 0's
    assert checksums_match(served["weights_checksum"], weights_checksum(new_state.items()))
    assert not checksums_match(served["weights_checksum"], weights_checksum(old_state.items()))


def test_generation_continues_while_the_first_update_is_pending(roles, redis_client):
    url, _ = start_server(roles)
    results: list[tuple[float, int, int]] = []  # (time, status, model_version)
    stop = threading.Event()

    def client():
        while not stop.is_set():
            status, reply = http_json(url + "/v1/completions", {"prompt": PROMPT, "n": 8, "max_tokens": 4})
            results.append((time.monotonic(), status, reply.get("model_version", -1)))

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    sender = WeightSender(roles.weight_sync_addr, world_size=2, timeout_s=30)
    try:
        epoch = sender.open()
        redis_client.xadd(KEYS.events, protocol.weights_ready(1, 8, epoch=epoch, version=1))
        # The server has seen the announcement and waits in the group's rendezvous for us: keep it waiting and
        # check that requests are still answered meanwhile.
        announced = time.monotonic()
        wait_for(lambda: sum(1 for t, *_ in results if t > announced) >= 5, 30, "requests during the join")
        assert health(url)[0] == 503
        sender.send(model_weights(str(roles.config), 1).items(), version=1)
        wait_version(url, 1)
        done = len(results)
        wait_for(lambda: len(results) >= done + 3, 30, "requests after the update")
    finally:
        stop.set()
        thread.join(timeout=30)
        sender.close()
    assert all(status == 200 for _, status, _ in results), results
    versions = [v for *_, v in results]
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1


def test_training_finished_leaves_the_group_and_serving_goes_on_until_sigterm(roles, redis_client):
    url, proc = start_server(roles)
    roles.start_trainer(0)
    wait_version(url, 0)
    redis_client.xadd(KEYS.events, protocol.training_finished(step=50))
    body = wait_for(lambda: (h := health(url)[1])["training_finished"] and h, 20, "training_finished")
    assert body["epoch"] is None  # left the group
    assert complete(url)["model_version"] == 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert "leaving the weight-update group" in log_text(proc)


def test_restarted_trainer_is_picked_up_in_a_new_epoch(roles):
    url, _ = start_server(roles)
    first = roles.start_trainer(0)
    publish(first, 1)
    old_epoch = wait_version(url, 1)["epoch"]
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)

    second = roles.start_trainer(1)  # resumed from its checkpoint at step 1, on the same port
    body = wait_for(lambda: (h := health(url)[1])["epoch"] not in (None, old_epoch) and h["updates"] >= 3 and h,
                      30, "the new epoch")
    assert body["model_version"] == 1
    publish(second, 2)
    wait_version(url, 2)
    choice = complete(url)["choices"][0]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        expected_logprobs(roles.config, model_weights(str(roles.config), 2), choice), abs=1e-4)


def test_restarted_inference_server_rejoins(roles):
    url, proc = start_server(roles)
    trainer = roles.start_trainer(0)
    publish(trainer, 1)
    wait_version(url, 1)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)

    url, _ = start_server(roles)  # same rank; finds the last epoch formed without it and asks for a new one
    wait_version(url, 1, timeout=60)
    publish(trainer, 2)  # and the trainer's next regular update reaches it too
    wait_version(url, 2)


def test_a_streamed_request_gets_the_batchs_tokens_as_server_sent_events(roles):
    url, _ = start_server(roles)
    body = {"model": "builtin://tiny-llama", "prompt": PROMPT, "n": 3, "max_tokens": 4, "logprobs": 0, "seed": 4}
    whole = complete(url, **body)
    chunks = http_stream(url + "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    *pieces, usage = chunks
    # One batch samples the whole request: a chunk per choice, the same tokens as without streaming.
    assert [c["choices"][0]["index"] for c in pieces] == [0, 1, 2]
    for chunk, choice in zip(pieces, whole["choices"], strict=True):
        got = chunk["choices"][0]
        assert chunk["object"] == "text_completion" and chunk["model_version"] == whole["model_version"] == 0
        assert got["token_ids"] == choice["token_ids"] and got["finish_reason"] == choice["finish_reason"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-6)
        assert got["prompt_token_ids"] == choice["prompt_token_ids"] and got["text"] == choice["text"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_bad_request_names_the_field(roles):
    url, _ = start_server(roles)
    status, reply = http_json(url + "/v1/completions", {"prompt": "12:", "max_tokens": 100})
    assert status == 400 and reply["error"]["param"] == "max_tokens"
    status, reply = http_json(url + "/v1/completions", {"prompt": "12:", "model": "other"})
    assert status == 404 and reply["error"]["param"] == "model"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_engine_without_vllm_fails_fast(tmp_path, redis_server):
    spec = job_spec()
    spec["inference"]["engine"] = "vllm"
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
    try:
        # `make test` points RLKUBE_VLLM_PYTHON at .venv-vllm, which the role would switch to: not here.
        proc = roles.start_role("inference", RLKUBE_PORT=str(free_port()), RLKUBE_VLLM_PYTHON="")
        assert proc.wait(timeout=60) != 0
        assert "vllm is not installed" in log_text(proc)
    finally:
        roles.cleanup()
