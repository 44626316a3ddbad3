"""The trainer role's weight publication with the real native inference server: both as subprocesses.

After training, the server's model version is the trainer's last step and its log-probs of a fixed completion
are those of the trainer's final checkpoint (and differ from the initial weights'), so every step's update went
over the weight-update group, in order, without a cast or a missing tensor.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import load_file

from core_roles import Role, add_documents, keys_for, make_documents, read_events, role_env, tiny_spec, wait_for
from rlkube.api.validation import parse_spec
from rlkube.core import checkpoint as ckpt
from rlkube.core import protocol, runtime
from rlkube.core.model import build_model, token_logprobs

START_TIMEOUT = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


@pytest.fixture
def roles():
    started: list[Role] = []
    yield started
    for r in started:  # inference first, as the teardown order says
        if r.proc.poll() is None:
            r.proc.terminate()
    for r in started:
        try:
            r.proc.wait(timeout=15)
        finally:
            r.kill()


def test_inference_serves_the_trainers_final_weights(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4, learningRate=0.01)
    keys = keys_for("sync", spec)
    port, http = _free_port(), _free_port()
    common = {runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{port}"}
    inference = Role("rlkube.core.inference",
                     role_env(tmp_path, "sync", spec, redis_server.url, **common, RLKUBE_PORT=str(http)),
                     tmp_path / "inference.log")
    roles.append(inference)
    trainer = Role("rlkube.core.trainer",
                   role_env(tmp_path, "sync", spec, redis_server.url, **common,
                            **{runtime.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt")}),
                   tmp_path / "trainer.log")
    roles.append(trainer)
    url = f"http://127.0.0.1:{http}"
    wait_for(lambda: _get(url + "/health")[0] == 200, START_TIMEOUT, "inference joined the group", inference)
    add_documents(redis_client, keys, make_documents(12))
    assert trainer.wait(START_TIMEOUT) == 0, trainer.log()
    finished = read_events(redis_client, keys, protocol.TRAINING_FINISHED)[0]
    assert finished.payload["step"] == 3
    ready = read_events(redis_client, keys, protocol.WEIGHTS_READY)
    assert [e.payload["version"] for e in ready] == [0, 1, 2, 3] and all(e.payload.get("epoch") for e in ready)

    status, body = _get(url + "/health")
    assert status == 200 and body["model_version"] == 3, body
    status, reply = _get(url + "/v1/completions", {"model": "builtin://tiny-lm", "prompt": "42:", "n": 2,
                                                   "max_tokens": 4, "temperature": 1.0, "logprobs": 0, "seed": 3})
    assert status == 200 and reply["model_version"] == 3, reply

    final = load_file(str(ckpt.Path(finished.payload["checkpoint"]) / ckpt.MODEL_FILE))
    initial = build_model(parse_spec(spec).model)
    trained = build_model(parse_spec(spec).model)
    trained.load_state_dict(final, strict=True)
    moved = 0.0
    for choice in reply["choices"]:
        tokens = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
        start = len(choice["prompt_token_ids"]) - 1
        with torch.no_grad():
            want = token_logprobs(trained(tokens), tokens)[0, start:].tolist()
            before = token_logprobs(initial(tokens), tokens)[0, start:].tolist()
        got = choice["logprobs"]["token_logprobs"]
        assert got == pytest.approx(want, abs=1e-4)
        moved = max(moved, max(abs(a - b) for a, b in zip(got, before, strict=True)))
    print(f"largest log-prob change vs the initial weights: {moved:.4f}")
    assert moved > 0.05, "the served weights are still the initial ones"
