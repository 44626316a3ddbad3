"""The first process of a Fast-LLM trainer pod: it supplies two things Fast-LLM cannot do itself, then runs
Fast-LLM's own launcher (`torchrun ... --no-python fast-llm train gpt --config ...`) as its child.

    python -m rlkube.core.launch.fast_llm --redis-listen 127.0.0.1:6379 --redis-upstream HOST:PORT \
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
   store before it starts torchrun (pipelinerl/launch.py on its fast-llm branch); so does this process. It also
   gives the store a fresh generation and announces it in the trainer's events before Fast-LLM starts: receivers
   still in a dead trainer's group join the new one (rlkube.contract.fast_llm_rendezvous.GENERATION_KEY).


Before it starts the child it checks two things that would otherwise only burn the job's restart budget:
3. The commands exist: an image without torchrun or Fast-LLM's `fast-llm` would make torchrun fail and this
   process exit 1 with nothing said, while the inference servers wait to join a broadcast that never comes. It
   exits runtime.EXIT_CONFIG with a termination message naming the image and the missing command, so the job
   fails at once (rlkube.lifecycle.policies.config_error).
4. The checkpoint is there (node 0, `--checkpoint-dir`): Fast-LLM resumes from whatever its directory holds and
   would start over at step 0 on an emptyDir that went with its pod. The newest step the trainer announced in its
   events (Fast-LLM's weights_ready) proves which checkpoint it saved (rlkube.contract.checkpoint_loss); when that
   one is gone the job fails with reason CheckpointLost, as a trainer of ours does.

The child's exit status is this process's (128 + signal number when it was killed), SIGTERM and SIGINT are passed
on to it (torchrun stops its workers), and the relay and the store live exactly as long as the child.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence

from rlkube.contract import checkpoint_loss, fast_llm_rendezvous, protocol, runtime
from rlkube.contract.runtime import ENV_REDIS_PASSWORD
from rlkube.core.errors import ConfigError, write_termination_message

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


def host_broadcast_store(port: int, generation: str | None = None):
    """Serve the TCPStore Fast-LLM's rank 0 and the inference servers meet in (clients only under torchrun), with
    its generation (a fresh one unless given) under fast_llm_rendezvous.GENERATION_KEY.

    Bound on every interface: Fast-LLM reaches it on loopback, the inference servers through the trainer Service."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("0.0.0.0", port, None, True, timedelta(seconds=300), wait_for_workers=False)
    store.set(fast_llm_rendezvous.GENERATION_KEY, generation or uuid.uuid4().hex)
    return store


ANNOUNCE_ATTEMPTS, ANNOUNCE_RETRY_S = 30, 2.0  # Redis may still be starting with the job's other pods


def announce_generation(client, stream: str, generation: str) -> None:
    """Tell the receivers a new broadcast store is open (protocol.BROADCAST_OPENED), before Fast-LLM starts: those
    still in an older generation's group leave it and join this one, so the new trainer's group constructor does
    not wait its whole timeout for them (rlkube.contract.fast_llm_rendezvous.GENERATION_KEY)."""
    import redis

    for attempt in range(ANNOUNCE_ATTEMPTS):
        try:
            client.xadd(stream, protocol.encode_event(protocol.BROADCAST_OPENED, generation=generation))
            return
        except redis.exceptions.ConnectionError as exc:
            if attempt + 1 == ANNOUNCE_ATTEMPTS:
                raise
            log.warning("announcing broadcast generation %s: %s; retrying", generation, exc)
            time.sleep(ANNOUNCE_RETRY_S)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


IMAGE_FIELD = "spec.trainer.image"


def programs(command: Sequence[str]) -> list[str]:
    """The commands `command` runs: its first word, and with torchrun's --no-python the program it starts."""
    out = [command[0]]
    if "--no-python" in command:
        i = list(command).index("--no-python")
        if i + 1 < len(command):
            out.append(command[i + 1])
    return out


def missing_command(command: Sequence[str], image: str | None, path: str | None) -> str | None:
    """Why the pod cannot run `command` (a program not on PATH), to be reported as `{IMAGE_FIELD}: {message}`;
    None when every program is there."""
    missing = [p for p in programs(command) if shutil.which(p, path=path) is None]
    if not missing:
        return None
    return (f"image {image or '(unknown)'} has no {' and no '.join(f'`{m}`' for m in missing)} command on its PATH "
            f"({path}): backend fast-llm needs an image with Fast-LLM installed (its `fast-llm` console script) "
            f"and torch's torchrun, such as rlkube's trainer-fast-llm image")


def newest_checkpoint(checkpoint_dir: str) -> int | None:
    """The newest step Fast-LLM's `{experiment_dir}/checkpoint/{step}` directories hold, None for none."""
    try:
        steps = [int(e.name) for e in os.scandir(os.path.join(checkpoint_dir, "checkpoint"))
                 if e.is_dir() and e.name.isdigit()]
    except OSError:
        return None
    return max(steps, default=None)


def announced_step(client, stream: str) -> int | None:
    """The newest step the trainer announced weights for in its events stream (any incarnation), None for none."""
    newest, cursor = None, "-"
    while True:
        entries = client.xrange(stream, cursor, "+", count=1000)
        for sid, fields in entries:
            event = protocol.decode_event(sid, fields)
            if event is not None and event.type == protocol.WEIGHTS_READY and event.step is not None:
                newest = event.step if newest is None else max(newest, event.step)
        if len(entries) < 1000:
            return newest
        cursor = "(" + protocol.text(entries[-1][0])


def checkpoint_loss_message(checkpoint_dir: str, interval: int, announced: int | None) -> str | None:
    """checkpoint_loss.loss for a Fast-LLM trainer about to start over `checkpoint_dir`."""
    saved = checkpoint_loss.fast_llm_saved(announced, interval)
    expected = None if saved is None else checkpoint_loss.fast_llm_checkpoint(checkpoint_dir, saved)
    return checkpoint_loss.loss(expected, newest_checkpoint(checkpoint_dir), checkpoint_dir)


def preflight(args, command: Sequence[str], env) -> ConfigError | None:
    """What makes this trainer pod unable to go on (3. and 4. above), as the error to report."""
    problem = missing_command(command, args.image, env.get("PATH"))
    if problem:
        return ConfigError(IMAGE_FIELD, problem)
    if args.checkpoint_dir:
        import redis

        host, port = args.redis_upstream
        client = redis.Redis(host=host, port=port, password=env.get(ENV_REDIS_PASSWORD) or None)
        try:
            announced = announced_step(client, args.events_stream)
        finally:
            client.close()
        problem = checkpoint_loss_message(args.checkpoint_dir, args.checkpoint_interval, announced)
        if problem:
            return ConfigError(checkpoint_loss.FIELD, problem)
    return None


def run(argv: Sequence[str] | None = None, env: dict | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlkube.core.launch.fast_llm", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-listen", type=_hostport, required=True, help="loopback host:port Fast-LLM uses")
    parser.add_argument("--redis-upstream", type=_hostport, required=True, help="the job's Redis, host:port")
    parser.add_argument("--broadcast-store-port", type=int, help="host the weight-broadcast TCPStore (node 0)")
    parser.add_argument("--image", help="the pod's image, named when a command is missing")
    parser.add_argument("--checkpoint-dir", help="Fast-LLM's run.experiment_dir: check the checkpoint is there")
    parser.add_argument("--checkpoint-interval", type=int, default=1, help="Fast-LLM's training.checkpoint.interval")
    parser.add_argument("--events-stream", default="fast_llm_events", help="the trainer's events stream")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command (torchrun ...)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    env = os.environ if env is None else env
    error = preflight(args, command, env)
    if error is not None:
        log.error("%s", error)
        write_termination_message(str(error))
        return runtime.EXIT_CONFIG

    relay = RedisAuthRelay(args.redis_listen, args.redis_upstream, env.get(ENV_REDIS_PASSWORD) or None).start()
    store = host_broadcast_store(args.broadcast_store_port) if args.broadcast_store_port else None
    if store is not None:
        import redis

        generation = store.get(fast_llm_rendezvous.GENERATION_KEY).decode()
        host, port = args.redis_upstream
        client = redis.Redis(host=host, port=port, password=env.get(ENV_REDIS_PASSWORD) or None, socket_timeout=30)
        try:
            announce_generation(client, args.events_stream, generation)
        finally:
            client.close()
        log.info("weight-broadcast generation %s announced in %s", generation, args.events_stream)
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
