"""The sandbox server (`python -m rlkube.core.sandbox`, rlkube.core.sandbox.server) as a real process, called by the
actor's client (rlkube.core.actor.sandbox_client): snippets run under the launcher's limits (a caller cannot ask
for more), the network refused, a 1 GiB write stopped at the output limit in a fresh directory that is gone
afterwards, and a server killed mid-snippet answered as a tool error (`unavailable`, counted) while the next call
goes to the next server and the episode goes on."""

from __future__ import annotations

import contextvars
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from rlkube.contract import runtime
from rlkube.core.actor.episodes import _tally
from rlkube.core.actor.sandbox import SandboxLimits
from rlkube.core.actor.sandbox_client import RemoteSandbox
from rlkube.local.ports import free_port
from support.waiting import wait_for

pytestmark = pytest.mark.integration
LIMITS = SandboxLimits(timeout_s=20, cpu_s=10, memory_mb=512, output_bytes=65536)


class Server:
    def __init__(self, work: Path, limits: SandboxLimits = LIMITS, **env: str):
        self.port, self.work = free_port(), work
        work.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlkube.core.sandbox"],
            env={"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                 runtime.ENV_BIND_HOST: "127.0.0.1", runtime.ENV_PORT: str(self.port),
                 runtime.ENV_SANDBOX_LIMITS: json.dumps(limits.to_json()), runtime.ENV_SANDBOX_WORK: str(work),
                 runtime.ENV_SANDBOX_REQUIRE_NETNS: "0", **env},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_for(self.health, 60, lambda: f"sandbox server on {self.port}: {self._err()}", 0.1)

    def _err(self) -> str:
        return "" if self.proc.poll() is None else self.proc.stderr.read().decode()[-2000:]

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def servers(tmp_path):
    made: list[Server] = []

    def start(n: int = 1, **env) -> list[Server]:
        made.extend(Server(tmp_path / f"work{len(made) + i}", **env) for i in range(n))
        return made[-n:]

    yield start
    for s in made:
        s.kill()


def test_a_snippet_runs_under_the_servers_limits_and_layers(servers):
    (s,) = servers()
    health = s.health()
    assert health["limits"]["memory_mb"] == 512 and set(health["layers"]) <= {"netns", "audit"}
    client = RemoteSandbox([s.url], SandboxLimits(memory_mb=65536))  # the caller's limits do not reach the server
    result = client.run("print(6 * 7)")
    assert result.outcome == "ok" and result.stdout == "42\n" and result.server == s.url
    big = client.run("x = bytearray(1024 * 2 ** 20)\nprint('allocated')")
    assert big.outcome == "memory" and "allocated" not in big.stdout, big


def test_the_network_is_refused_and_a_1gib_write_stops_in_a_fresh_directory_removed_after(servers):
    (s,) = servers()
    client = RemoteSandbox([s.url], LIMITS)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    result = client.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
    assert result.outcome == "refused" and "in" not in result.stdout.split(), result
    assert select.select([listener], [], [], 0.2)[0] == []
    listener.close()
    write = client.run("import os\nprint(os.getcwd(), flush=True)\nwith open('big', 'wb') as f:\n"
                       "    for _ in range(1024):\n        f.write(b'0' * 2 ** 20)\nprint('wrote 1 GiB')")
    assert write.outcome == "output" and "wrote 1 GiB" not in write.stdout, write
    cwd = Path(write.stdout.split()[0])
    assert cwd.is_relative_to(s.work) and not cwd.exists() and list(s.work.iterdir()) == []
    env = client.run("import os, json\nprint(json.dumps(dict(os.environ)))")
    assert not [k for k in json.loads(env.stdout) if k.startswith("RLKUBE_")], env.stdout


def test_each_layer_alone_refuses_the_network(servers):
    for layers, refused_by in (("audit", "audit hook"), ("netns", "network namespace")):
        (s,) = servers(**{runtime.ENV_SANDBOX_LAYERS: layers})
        assert s.health()["layers"] == [layers]
        r = RemoteSandbox([s.url], LIMITS).run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
        assert r.outcome == "refused" and r.refused_by == refused_by, r


def test_a_server_killed_mid_snippet_is_a_tool_error_and_the_next_call_goes_to_the_next_server(servers):
    a, b = servers(2)
    client = RemoteSandbox([a.url, b.url], LIMITS)
    tally: dict[str, int] = {}
    token = _tally.set(tally)
    try:
        out: list = []
        ctx = contextvars.copy_context()  # the episode's tally, as the actor's tool threads carry it
        call = threading.Thread(target=lambda: out.append(ctx.run(client.run, "import time\ntime.sleep(15)")))
        call.start()
        wait_for(lambda: any(a.work.iterdir()), 30, "the snippet running on server a")
        a.kill()
        call.join(30)
        (lost,) = out
        assert lost.outcome == "unavailable" and lost.server == a.url, lost
        assert "did not answer" in lost.message()
        nxt = client.run("print('still here')")
        assert nxt.outcome == "ok" and nxt.server == b.url and nxt.stdout == "still here\n"
    finally:
        _tally.reset(token)
    assert tally == {"tool_errors": 1}
