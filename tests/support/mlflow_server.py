"""A real `mlflow server` for the tracking tests: SQLite backend store and a served artifact root in a temporary
directory, on a free loopback port, in its own virtual environment (.venv-mlflow, `make deps-mlflow`: the full
mlflow server pins python-dateutil<3 through graphene, which the kubernetes client of the test environment
refuses, so it cannot share .venv). Started by a fixture, registered in cluster.tracked, stopped at its end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request
from pathlib import Path

from cluster.tracked import track
from support.waiting import wait_for

from rlkube.local.ports import free_port
from support import ROOT

ENV_MLFLOW = "RLKUBE_MLFLOW"
"""The `mlflow` executable of the server's environment (default: .venv-mlflow/bin/mlflow)."""


def mlflow_executable() -> Path:
    return Path(os.environ.get(ENV_MLFLOW) or ROOT / ".venv-mlflow" / "bin" / "mlflow")


class MlflowServer:
    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = self.workdir / "mlflow-server.log"

    def start(self, timeout_s: float = 120) -> MlflowServer:
        exe = mlflow_executable()
        if not exe.exists():
            raise FileNotFoundError(f"{exe} is missing: `make deps-mlflow` builds the mlflow server's environment "
                                    f"(or set {ENV_MLFLOW})")
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [str(exe), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                "--backend-store-uri", f"sqlite:///{self.workdir / 'mlflow.db'}",
                "--serve-artifacts", "--artifacts-destination", str(self.workdir / "artifacts")]
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.workdir)
        track("mlflow-server", self.proc.pid)
        wait_for(self._healthy, timeout_s, lambda: f"mlflow server on {self.url}: {self._tail()}", interval=0.5)
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited {self.proc.returncode}: {self._tail()}")
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # uvicorn/gunicorn workers are in its process group
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
