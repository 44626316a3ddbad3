"""Helpers for the trainer/preprocessor role tests: job configs, role subprocesses with the runtime.py env (and the
fixtures that stop them), a trainer and an inference server joined by a weight-update group, synthetic documents
and rollout groups, and event polling with deadlines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from cluster.control_plane import free_port
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import protocol, runtime
from support.hf_models import initial_model
from rlkube.core.hf.loading import load_model
from rlkube.core.training.losses import token_logprobs
from support import specs
from support import waiting
from support import ROOT

NAMESPACE = "test"


def tiny_spec(**algorithm) -> dict:
    """examples/tiny-cpu.yaml's spec (camelCase) with algorithm overrides."""
    return specs.spec(**{f"algorithm.{k}": v for k, v in algorithm.items()})


def keys_for(job: str, spec: dict) -> protocol.StreamKeys:
    return protocol.StreamKeys.for_job(NAMESPACE, job, spec.get("trainer", {}).get("backend", "torch"))


def role_env(tmp: Path, job: str, spec: dict, redis_url: str, **extra: str) -> dict[str, str]:
    config = runtime.write_job_config(tmp / f"{job}.json", NAMESPACE, job, spec)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLKUBE_")}
    env.update({
        runtime.ENV_CONFIG: str(config),
        runtime.ENV_REDIS_URL: redis_url,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


class Role:
    """A role subprocess whose output goes to a log file (read back in assertion messages)."""

    def __init__(self, module: str, env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=ROOT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log_path.name} still running after {timeout}s:\n{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def stop_roles(started: list[Role], grace: float = 0.0) -> None:
    """With `grace`: SIGTERM every role still running, in start order, and fail (TimeoutExpired) when one has not
    exited `grace` seconds later. Then SIGKILL whatever is left."""
    try:
        if grace:
            for r in started:
                if r.proc.poll() is None:
                    r.proc.terminate()
            for r in started:
                r.proc.wait(timeout=grace)
    finally:
        for r in started:
            r.kill()


@pytest.fixture(name="roles")
def roles_fixture():
    """The roles a test starts (start_role appends them); SIGKILLed at teardown."""
    started: list[Role] = []
    yield started
    stop_roles(started)


@pytest.fixture(name="graceful_roles")
def graceful_roles_fixture():
    """Like `roles`, but SIGTERMed at teardown in start order (inference before the trainer, as the teardown order
    says), so they leave the weight-update group cleanly; SIGKILLed after 15 s."""
    started: list[Role] = []
    yield started
    stop_roles(started, grace=15)


def start_role(roles: list[Role], role: str, tmp: Path, job: str, spec: dict, redis_url: str, **env: str) -> Role:
    """`python -m rlkube.core.<role>` for the job, logging to its own file, added to `roles` for teardown."""
    process = Role(f"rlkube.core.{role}", role_env(tmp, job, spec, redis_url, **env),
                   tmp / f"{job}-{role}-{len(roles)}.log")
    roles.append(process)
    return process


def start_trainer(roles: list[Role], tmp: Path, job: str, spec: dict, redis_url: str, ckpt_dir: Path | None = None,
                  **env: str) -> Role:
    """The trainer role, checkpointing under `ckpt_dir` (tmp/ckpt unless given)."""
    return start_role(roles, "trainer", tmp, job, spec, redis_url,
                      **{runtime.ENV_CHECKPOINT_DIR: str(ckpt_dir or tmp / "ckpt")}, **env)


def http_json(url: str, body: dict | None = None) -> tuple[int, dict]:
    """GET (or POST `body`) and the JSON reply; (0, {}) while nothing listens."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def start_trainer_and_inference(roles: list[Role], tmp: Path, job: str, spec: dict, redis_url: str,
                                timeout: float) -> tuple[Role, str]:
    """The native inference server and the trainer, joined by a weight-update group on a free port: (the trainer,
    the server's URL) once the server is healthy (it has joined the group and received version 0)."""
    sync = {runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{free_port()}"}
    http = free_port()
    inference = start_role(roles, "inference", tmp, job, spec, redis_url, **sync, RLKUBE_PORT=str(http))
    trainer = start_trainer(roles, tmp, job, spec, redis_url, **sync)
    url = f"http://127.0.0.1:{http}"
    wait_for(lambda: http_json(url + "/health")[0] == 200, timeout, "inference joined the group", inference)
    return trainer, url


def train_with_inference(roles: list[Role], tmp: Path, job: str, spec: dict, client, redis_url: str,
                         timeout: float) -> tuple[Role, str, protocol.TrainerEvent]:
    """The whole job (maxSteps x samplesPerStep documents) with the trainer and the native inference server joined by
    a weight-update group: the trainer exits 0 after publishing every version in order, each with its group epoch.
    Returns (the trainer, the server's URL, training_finished)."""
    trainer, url = start_trainer_and_inference(roles, tmp, job, spec, redis_url, timeout)
    keys, steps = keys_for(job, spec), spec["algorithm"]["maxSteps"]
    add_documents(client, keys, make_documents(steps * spec["algorithm"]["samplesPerStep"]))
    assert trainer.wait(timeout) == 0, trainer.log()
    finished = read_events(client, keys, protocol.TRAINING_FINISHED)[0]
    assert finished.payload["step"] == steps
    ready = read_events(client, keys, protocol.WEIGHTS_READY)
    assert [e.payload["version"] for e in ready] == list(range(steps + 1)), ready
    assert all(e.payload.get("epoch") for e in ready), ready  # every transfer names its group epoch
    return trainer, url, finished


def assert_serves_checkpoint(url: str, spec: dict, checkpoint: Path, version: int, n: int) -> None:
    """The server at `url` is at `version`, and its log-probs of n sampled completions are those of the checkpoint's
    weights (the checkpoint is a HF directory: transformers loads it as it is) and clearly not the initial weights'."""
    status, body = http_json(url + "/health")
    assert status == 200 and body["model_version"] == version, body
    status, reply = http_json(url + "/v1/completions", {"model": "builtin://tiny-llama", "prompt": "42:", "n": n,
                                                        "max_tokens": 4, "temperature": 1.0, "logprobs": 0, "seed": 3})
    assert status == 200 and reply["model_version"] == version, reply
    trained, initial = load_model(checkpoint), initial_model(parse_spec(spec).model)
    moved = 0.0
    for choice in reply["choices"]:
        tokens = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"]])
        start = len(choice["prompt_token_ids"]) - 1
        with torch.no_grad():
            want = token_logprobs(trained(tokens).logits, tokens)[0, start:].tolist()
            before = token_logprobs(initial(tokens).logits, tokens)[0, start:].tolist()
        got = choice["logprobs"]["token_logprobs"]
        assert got == pytest.approx(want, abs=1e-4)
        moved = max(moved, max(abs(a - b) for a, b in zip(got, before, strict=True)))
    print(f"largest log-prob change vs the initial weights: {moved:.4f}")
    assert moved > 0.05, "the served weights are still the initial ones"


def make_documents(n: int, version: int = 0, seed: int = 0, prompt_len: int = 4, completion_len: int = 3):
    """Valid Fast-LLM documents like the preprocessor writes (prompt excluded, old log-probs on the completion)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        length = prompt_len + completion_len
        tokens = rng.integers(3, 13, size=length).astype(np.int64)
        tokens[0] = 1  # <bos>
        old = np.zeros(length, dtype=np.float32)
        old[prompt_len:] = -rng.uniform(2.5, 5.0, size=completion_len)
        docs.append(protocol.Document(
            tokens=tokens, loss_masking_spans=[(0, prompt_len)], advantage=float(rng.normal()),
            reward=float(rng.uniform()), old_log_probabilities=old,
            model_version=np.full(length, version, dtype=np.int64),
        ))
    return docs


def add_documents(client, keys: protocol.StreamKeys, docs) -> None:
    for doc in docs:
        client.xadd(keys.documents, protocol.encode_document(doc))


def make_group(group_id: str, rewards: list[float], expected: int, version: int = 0) -> protocol.RolloutGroup:
    samples = [protocol.Sample([10 + i % 5, 11, 2], [-1.0, -2.0, -0.5], r) for i, r in enumerate(rewards)]
    return protocol.RolloutGroup(group_id, [1, 4, 5, 16], samples, model_version=version, expected_size=expected)


def read_events(client, keys: protocol.StreamKeys, type_: str | None = None) -> list[protocol.TrainerEvent]:
    out = []
    for sid, fields in client.xrange(keys.events):
        event = protocol.decode_event(sid, fields)
        if event is not None and (type_ is None or event.type == type_):
            out.append(event)
    return out


def wait_for(predicate, timeout: float, what: str, role: Role | None = None, interval: float = 0.05):
    """waiting.wait_for, failing early when `role` exits and with the role's log on a timeout."""
    if role is None:
        return waiting.wait_for(predicate, timeout, what, interval)

    def check():
        value = predicate()
        if not value and role.proc.poll() is not None:
            raise AssertionError(f"{what}: the role exited with {role.proc.returncode}:\n{role.log()}")
        return value

    try:
        return waiting.wait_for(check, timeout, what, interval)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}:\n{role.log()}") from None


def wait_for_event(client, keys, type_: str, timeout: float, role: Role | None = None, where=lambda e: True):
    def found():
        matches = [e for e in read_events(client, keys, type_) if where(e)]
        return matches[0] if matches else None

    return wait_for(found, timeout, f"event {type_}", role)
