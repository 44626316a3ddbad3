"""The trainer ROLE on the megatron backend (`spec.trainer.backend: megatron`) with the native inference server,
both as subprocesses over real Redis and the gloo weight-update group (megatron tier).

The megatron-core GPTModel's weights reach the server in TinyLM's names and layout: after training, the served
log-probs of fixed completions are the final checkpoint's (and not the initial weights'), and the checkpoint is
the same format the torch backend writes.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
import torch
from core_roles import (
    Role,
    add_documents,
    keys_for,
    make_documents,
    read_events,
    role_env,
    tiny_spec,
    wait_for,
)
from megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.api.validation import parse_spec
from rlkube.core import checkpoint as ckpt
from rlkube.core import protocol, runtime
from rlkube.core.model import build_model, token_logprobs
from safetensors.torch import load_file

pytestmark = pytest.mark.megatron

START_TIMEOUT = 120  # two processes importing torch (and megatron-core) on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(url: str, body: dict | None = None) -> tuple[int, dict]:
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
    for r in started:
        if r.proc.poll() is None:
            r.proc.terminate()
    for r in started:
        try:
            r.proc.wait(timeout=15)
        finally:
            r.kill()


def test_megatron_trainer_weights_are_served_by_native_inference(redis_client, redis_server, tmp_path, roles):
    spec = tiny_spec(maxSteps=3, samplesPerStep=4, learningRate=0.01)
    spec["trainer"]["backend"] = "megatron"
    keys = keys_for("meg", spec)
    port, http = _free_port(), _free_port()
    common = {runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{port}"}
    inference = Role("rlkube.core.inference",
                     role_env(tmp_path, "meg", spec, redis_server.url, **common, RLKUBE_PORT=str(http)),
                     tmp_path / "inference.log")
    roles.append(inference)
    trainer = Role("rlkube.core.trainer",
                   role_env(tmp_path, "meg", spec, redis_server.url, **common,
                            **{runtime.ENV_CHECKPOINT_DIR: str(tmp_path / "ckpt")}),
                   tmp_path / "trainer.log")
    roles.append(trainer)
    url = f"http://127.0.0.1:{http}"
    wait_for(lambda: _call(url + "/health")[0] == 200, START_TIMEOUT, "inference joined the group", inference)
    add_documents(redis_client, keys, make_documents(12))
    assert trainer.wait(START_TIMEOUT) == 0, trainer.log()
    assert "Traceback" not in trainer.log(), trainer.log()
    finished = read_events(redis_client, keys, protocol.TRAINING_FINISHED)[0]
    assert finished.payload["step"] == 3 and finished.payload["interrupted"] is False
    ready = read_events(redis_client, keys, protocol.WEIGHTS_READY)
    assert [e.payload["version"] for e in ready] == [0, 1, 2, 3]
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [1, 2, 3]
    path = ckpt.Path(finished.payload["checkpoint"])
    assert ckpt.read_meta(path).extra == {"backend": "megatron"}

    status, body = _call(url + "/health")
    assert status == 200 and body["model_version"] == 3, body
    status, reply = _call(url + "/v1/completions", {"model": "builtin://tiny-lm", "prompt": "42:", "n": 3,
                                                    "max_tokens": 4, "temperature": 1.0, "logprobs": 0, "seed": 3})
    assert status == 200 and reply["model_version"] == 3, reply

    # the checkpoint is TinyLM's state_dict (strict load), and the server computes with exactly those weights
    trained, initial = build_model(parse_spec(spec).model), build_model(parse_spec(spec).model)
    trained.load_state_dict(load_file(str(path / ckpt.MODEL_FILE)), strict=True)
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
