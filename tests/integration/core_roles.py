"""Helpers for the trainer/preprocessor role tests: job configs, role subprocesses with the runtime.py env,
synthetic documents and rollout groups, and event polling with deadlines."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

from rlkube.core import protocol, runtime

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "test"


def tiny_spec(**algorithm) -> dict:
    """examples/tiny-cpu.yaml's spec (camelCase) with algorithm overrides."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
    spec = copy.deepcopy(doc["spec"])
    spec["algorithm"].update(algorithm)
    return spec


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
    """Poll `predicate` until it returns something truthy; fail with `what` (and the role's log) on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if role is not None and role.proc.poll() is not None:
            raise AssertionError(f"{what}: the role exited with {role.proc.returncode}:\n{role.log()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f":\n{role.log()}" if role else ""))
        time.sleep(interval)


def wait_for_event(client, keys, type_: str, timeout: float, role: Role | None = None, where=lambda e: True):
    def found():
        matches = [e for e in read_events(client, keys, type_) if where(e)]
        return matches[0] if matches else None

    return wait_for(found, timeout, f"event {type_}", role)
