"""Helpers shared by the inference and actor tests: job configs, role processes, HTTP and polling.

Role processes are started exactly as the launchers start them (`python -m rlkube.core.<role>` with the
RLKUBE_* environment); `RoleProcesses` kills whatever is still running when its test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlkube.contract import runtime
from rlkube.local.ports import free_port
from support.waiting import wait_for  # noqa: F401 (the serving tests import it from here)

NAMESPACE, JOB = "ns", "job"
PREFIX = f"{NAMESPACE}/{JOB}/"
PEER = Path(__file__).parent / "weightsync_peer.py"


def job_spec(**algorithm: Any) -> dict[str, Any]:
    return {
        "model": {"path": "builtin://tiny-llama", "seed": 7, "maxSequenceLength": 32},
        "task": {"name": "reverse-digits"},
        "algorithm": {"maxSteps": 50, "groupSize": 4, "samplesPerStep": 8, "maxLag": 1, "maxNewTokens": 4,
                      **algorithm},
        "inference": {"engine": "native", "replicas": 1},
    }


def write_config(directory: Path, spec: dict[str, Any]) -> Path:
    return runtime.write_job_config(Path(directory) / "job.json", NAMESPACE, JOB, spec)


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def http_stream(url: str, body: dict, timeout: float = 120) -> list[dict]:
    """The chunks of a streamed completion (`stream: true`: server-sent events up to `data: [DONE]`)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream"), resp.headers
        for line in resp:
            if not line.strip():
                continue
            assert line.startswith(b"data: "), line
            if line.strip() == b"data: [DONE]":
                return chunks
            chunks.append(json.loads(line[len(b"data: "):]))
    raise AssertionError(f"the stream ended without [DONE] after {len(chunks)} chunks")


def http_status(url: str) -> int | None:
    try:
        return http_json(url, timeout=2)[0]
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class RoleProcesses:
    """Starts role processes and trainer stand-ins; `cleanup()` kills every one still running."""

    def __init__(self, tmp_path: Path, redis_url: str, config: Path):
        self.tmp = tmp_path
        self.redis_url = redis_url
        self.config = config
        self.procs: list[subprocess.Popen] = []
        self.weight_sync_addr = f"127.0.0.1:{free_port()}"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            runtime.ENV_CONFIG: str(self.config),
            runtime.ENV_REDIS_URL: self.redis_url,
            runtime.ENV_WEIGHT_SYNC: self.weight_sync_addr,
            runtime.ENV_BIND_HOST: "127.0.0.1",
            **extra,
        }

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}-{len(self.procs)}.log"

    def start_role(self, role: str, name: str | None = None, **env: str) -> subprocess.Popen:
        path = self.log(name or role)
        with open(path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", f"rlkube.core.{role}"], stdout=log,
                                    stderr=subprocess.STDOUT, env=self.env(**env))
        proc.log_path = path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def start_trainer(self, first_version: int, world_size: int = 2, **env: str) -> subprocess.Popen:
        """A trainer stand-in (weightsync_peer.py) publishing the job's model, nudged per version (`env`: its
        PEER_* settings)."""
        path = self.log("trainer")
        with open(path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(PEER), self.weight_sync_addr, str(world_size), self.redis_url, PREFIX,
                 str(first_version), str(self.config)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env(**env),
            )
        proc.log_path = path  # type: ignore[attr-defined]
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            for stream in (proc.stdin, proc.stdout):
                if stream:
                    stream.close()


def publish(trainer: subprocess.Popen, version: int, documents_seen: int | None = None) -> None:
    trainer.stdin.write(f"{version}\n" if documents_seen is None else f"{version} {documents_seen}\n")
    trainer.stdin.flush()


def log_text(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
