"""A private redis-server process on a free loopback port.

Used by `rlkube local` (one Redis per job, like the managed mode in a cluster) and by the test fixtures.
No persistence, no config file: everything on the command line, so nothing outside `workdir` is touched.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from rlkube.local.ports import free_port


class RedisNotInstalled(RuntimeError):
    pass


class RedisServer:
    def __init__(
        self,
        workdir: Path,
        password: str | None = None,
        binary: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        """`port=0` picks a free port; a fixed host/port lets a test stand in for a pod at its pod IP."""
        self.workdir = Path(workdir)
        self.password = password
        self.host = host
        self.fixed_port = port
        self.binary = binary or os.environ.get("REDIS_SERVER_BIN") or shutil.which("redis-server")
        if not self.binary:
            raise RedisNotInstalled(
                "redis-server not found on PATH: install it (Debian: apt-get install redis-server) "
                "or set REDIS_SERVER_BIN"
            )
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)

    def start(self, timeout: float = 15.0) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = self.fixed_port or free_port()
        argv = [
            self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
            "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "no",
        ]
        if self.password:
            argv += ["--requirepass", self.password]
        log = open(self.workdir / "redis.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        client = self.client(socket_connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.workdir}/redis.log")
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server not answering on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
