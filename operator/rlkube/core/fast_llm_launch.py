"""The first process of a Fast-LLM trainer pod: it supplies two things Fast-LLM cannot do itself, then runs
Fast-LLM's own launcher (`torchrun ... --no-python fast-llm train gpt --config ...`) as its child.

    python -m rlkube.core.fast_llm_launch --redis-listen 127.0.0.1:6379 --redis-upstream HOST:PORT \
        [--broadcast-store-port 29500] -- torchrun ...

1. Redis with a password. Fast-LLM's RedisConfig has `host`, `port` and `timeout` only and connects with
   `redis.Redis(host, port)` (fast_llm/data/dataset/config.py, RedisConfig.get_client, whose TODO says a
   `password` field is yet to come; the streaming dataset connects the same way in
   fast_llm/data/dataset/streaming.py). The job's Redis requires the password in its Secret, and a Secret value
   must not be written into the ConfigMap. So this process listens on a loopback port of the pod and relays each
   connection to the job's Redis after authenticating it with REDIS_PASSWORD (from the Secret). Nothing outside
   the pod can reach a loopback port, so the relay adds no unauthenticated way into Redis.
2. The weight-broadcast store (node 0 only). Fast-LLM's rank 0 joins the broadcast group with
   `torch.distributed.rendezvous("tcp://host:port", 0, n)` (fast_llm/engine/training/streaming.py and
   ProcessGroupPool in fast_llm/engine/distributed/distributed.py). torchrun gives its workers
   TORCHELASTIC_USE_AGENT_STORE=True, which makes that rendezvous a client only, so no process would serve the
   store and rank 0 and the inference servers would wait for each other forever. PipelineRL's launcher hosts the
   store before it starts torchrun (pipelinerl/launch.py on its fast-llm branch); so does this process.

The child's exit status is this process's (128 + signal number when it was killed), SIGTERM and SIGINT are passed
on to it (torchrun stops its workers), and the relay and the store live exactly as long as the child.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from rlkube.contract.runtime import ENV_REDIS_PASSWORD

log = logging.getLogger("rlkube.fast_llm_launch")

_CHUNK = 1 << 16


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not host:port")
    return host.strip("[]"), int(port)


def _resp(*parts: str) -> bytes:
    """One Redis command in RESP, the protocol's array of bulk strings."""
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _read_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\r\n"):
        byte = sock.recv(1)
        if not byte:
            break
        line += byte
    return line


class RedisAuthRelay:
    """A loopback TCP relay that authenticates every connection it opens to the upstream Redis.

    The client speaks plain RESP to the relay and never sees the password; the upstream sees an ordinary client
    that sent AUTH first. One thread per direction per connection: Fast-LLM opens a handful (one per data loader
    and one for the events of rank 0), each long-lived."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], password: str | None,
                 connect_timeout_s: float = 30.0):
        self.upstream, self.password, self.connect_timeout_s = upstream, password, connect_timeout_s
        self._server = socket.create_server(listen, reuse_port=False)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> RedisAuthRelay:
        thread = threading.Thread(target=self._accept_loop, name="redis-relay", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), name="redis-relay-conn", daemon=True).start()

    def _open_upstream(self) -> socket.socket:
        up = socket.create_connection(self.upstream, timeout=self.connect_timeout_s)
        if self.password:
            up.sendall(_resp("AUTH", self.password))
            reply = _read_line(up)
            if not reply.startswith(b"+OK"):
                up.close()
                # The reply names the failure (WRONGPASS, ...); it never contains the password.
                raise ConnectionError(f"Redis at {self.upstream[0]}:{self.upstream[1]} refused AUTH: "
                                      f"{reply.decode(errors='replace').strip()}")
        up.settimeout(None)
        return up

    def _serve(self, client: socket.socket) -> None:
        try:
            up = self._open_upstream()
        except (OSError, ConnectionError) as exc:
            log.error("redis relay: %s", exc)
            client.close()
            return
        _Connection(client, up).start()

    def close(self) -> None:
        self._closed.set()
        self._server.close()


class _Connection:
    """One relayed connection: a pump per direction; when a side ends, the other side sees EOF (as it would have
    from the real peer); when both have ended, both sockets are closed."""

    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client, self.upstream = client, upstream
        self._lock = threading.Lock()
        self._running = 2

    def start(self) -> None:
        for src, dst in ((self.client, self.upstream), (self.upstream, self.client)):
            threading.Thread(target=self._pump, args=(src, dst), name="redis-relay-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(_CHUNK):
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self.client.close()
            self.upstream.close()


def host_broadcast_store(port: int):
    """Serve the TCPStore Fast-LLM's rank 0 and the inference servers meet in (clients only under torchrun).

    Bound on every interface: Fast-LLM reaches it on loopback, the inference servers through the trainer Service."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("0.0.0.0", port, None, True, timedelta(seconds=300), wait_for_workers=False)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(argv: Sequence[str] | None = None, env: dict | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkube.core.fast_llm_launch", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-listen", type=_hostport, required=True, help="loopback host:port Fast-LLM uses")
    parser.add_argument("--redis-upstream", type=_hostport, required=True, help="the job's Redis, host:port")
    parser.add_argument("--broadcast-store-port", type=int, help="host the weight-broadcast TCPStore (node 0)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command (torchrun ...)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    env = os.environ if env is None else env

    relay = RedisAuthRelay(args.redis_listen, args.redis_upstream, env.get(ENV_REDIS_PASSWORD) or None).start()
    store = host_broadcast_store(args.broadcast_store_port) if args.broadcast_store_port else None
    log.info("redis relay %s:%d -> %s:%d%s; starting %s", *relay.address, *args.redis_upstream,
             f"; weight-broadcast store on port {args.broadcast_store_port}" if store is not None else "",
             " ".join(command))
    child = subprocess.Popen(command, env={k: v for k, v in env.items() if k != ENV_REDIS_PASSWORD})

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        relay.close()
        del store
    return _exit_code(returncode)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(run())


if __name__ == "__main__":
    main()
