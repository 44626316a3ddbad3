"""Starts a trainer pod's local ranks: one `python -m rlkube.core.trainer` per GPU (or per
spec.trainer.processesPerNode on CPU), as torchrun's static rendezvous would, and stands for them as the pod's
one process.

Why not torchrun itself: torchrun's agent hosts its own TCPStore on MASTER_PORT, where our data-parallel group
(rlkube.core.backends.torch_distributed) already keeps its store with liveness and stop keys; its rank
arithmetic would live inside torch instead of rlkube.lifecycle.environment, which `rlkube local` shares with the
operator; and it reports a failed worker as its own error, not the rank's termination message. This launcher
adds only what torchrun's worker env adds (contract.parallel.rank_env: RANK = NODE_RANK * LOCAL_WORLD_SIZE +
LOCAL_RANK, LOCAL_RANK, GROUP_RANK) to the pod's env (WORLD_SIZE, NODE_RANK, NNODES, LOCAL_WORLD_SIZE,
MASTER_ADDR/PORT).

Behaviour, as the operator and `rlkube local` expect of a trainer process:
- SIGTERM/SIGINT are passed to every rank (kubelet signals only the container's first process); the ranks stop
  together after the same step and the launcher waits for them all;
- the exit code is 0 only when every rank exited 0; else that of the first rank that failed. The other ranks are
  then sent SIGTERM and, after FAILURE_GRACE_S, SIGKILL (a data-parallel group with a dead member cannot go on);
- the first failed rank's termination message (each rank writes its own file) is the pod's, prefixed with the
  rank; each rank's output lines are prefixed `[rank R]` in the pod log.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rlkube.contract import runtime
from rlkube.contract.context import RoleContext
from rlkube.core.errors import write_termination_message
from rlkube.contract.parallel import processes_per_node, rank_env

log = logging.getLogger("rlkube.launcher")

FAILURE_GRACE_S = 15.0
"""How long the other ranks get after one failed, before SIGKILL (torchrun gives its workers 30 s)."""
TAIL_LINES = 20


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: no orphaned child


def exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell and kubelet report it


class Child:
    """One process a pod's first process supervises (a rank here, the colocated trainer and engine in
    rlkube.core.launch.colocated): its output relayed line by line as `[label] ...`, its last lines kept, and its
    termination message read from a file of its own."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], message_path: Path):
        self.label = label
        self.message_path = message_path
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen(argv, env={**env, runtime.ENV_TERMINATION_LOG: str(message_path)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=die_with_parent)
        self.reader = threading.Thread(target=self._relay, name=f"{label}-output", daemon=True)
        self.reader.start()

    def _relay(self) -> None:
        assert self.proc.stdout is not None
        prefix = f"[{self.label}] ".encode()
        for line in iter(self.proc.stdout.readline, b""):
            self.tail.append(line.decode(errors="replace").rstrip())
            sys.stdout.buffer.write(prefix + line)
            sys.stdout.buffer.flush()

    def signal(self, sig: int) -> None:
        # os.kill, not Popen.send_signal: that polls (reaps) the child, which os.wait() in run() must see.
        if self.proc.returncode is None:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def reported(self) -> str:
        """What the child said of its end: its termination message, else its last output lines."""
        try:
            text = self.message_path.read_text().strip()
        except OSError:
            text = ""
        return text or "\n".join(self.tail)


class Rank(Child):
    def __init__(self, node: int, local: int, env: dict[str, str], message_dir: Path):
        self.node, self.local = node, local
        self.rank = int(dict(env)["RANK"])
        super().__init__(f"rank {self.rank}", [sys.executable, "-m", "rlkube.core.trainer"], env,
                         message_dir / f"rank-{self.rank}.termination-log")

    def message(self, code: int) -> str:
        return (f"trainer rank {self.rank} (node {self.node}, local rank {self.local}) exited {code}: "
                f"{self.reported()}")


def run(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    ctx = RoleContext.from_env(env)
    node = ctx.index
    per_node = processes_per_node(ctx.spec)
    message_dir = Path(tempfile.mkdtemp(prefix="rlkube-ranks-"))
    ranks: dict[int, Rank] = {}

    def forward(signum, _frame):
        log.info("signal %d: passing it to %d rank(s)", signum, sum(r.proc.returncode is None for r in ranks.values()))
        for r in ranks.values():
            r.signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for local in range(per_node):
        rank = Rank(node, local, {**env, **dict(rank_env(ctx.spec, node, local))}, message_dir)
        ranks[rank.proc.pid] = rank
    log.info("node %d: started ranks %s", node, sorted(r.rank for r in ranks.values()))

    failed: tuple[Rank, int] | None = None
    killer: threading.Timer | None = None
    running = dict(ranks)
    while running:
        try:
            pid, status = os.wait()  # retried after a signal handler ran (PEP 475)
        except ChildProcessError:  # cannot happen while a rank runs; never spin on it
            break
        rank = running.pop(pid, None)
        if rank is None:
            continue
        rank.proc.returncode = code = exit_code(status)
        rank.reader.join(timeout=5)
        log.info("rank %d exited %d", rank.rank, code)
        if code != 0 and failed is None:
            failed = (rank, code)
            if running:
                log.error("rank %d failed: stopping the other %d rank(s)", rank.rank, len(running))
                for other in running.values():
                    other.signal(signal.SIGTERM)
                others = list(running.values())
                killer = threading.Timer(FAILURE_GRACE_S, lambda: [o.signal(signal.SIGKILL) for o in others])
                killer.daemon = True
                killer.start()
    if killer is not None:
        killer.cancel()
    for rank in running.values():  # lost track of it (see above): not a success
        failed = failed or (rank, 1)
    if failed is None:
        return 0
    rank, code = failed
    message = rank.message(code)
    log.error("%s", message)
    write_termination_message(message)
    return code


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    return run()


if __name__ == "__main__":
    sys.exit(main())
