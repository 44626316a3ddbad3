"""A colocated trainer (spec.inference.placement `colocated`, docs/guide/colocated.md): the trainer and its native
engine as two child processes of one pod (or one local process group), sharing its devices.

Why one process that starts both, not two containers: a device plugin hands a GPU to one container of a pod, so
the two processes that share it must live in one container; and one supervisor, not the trainer starting its
engine, keeps the trainer unchanged and lets either child fail without taking the other's report with it. It
stands for both as the container's one process, like rlkube.core.launch.ranks does for several ranks:
- the trainer gets this process's environment; the engine the same, turned into an inference role's by
  runtime.ENV_COLOCATED_ENGINE (lifecycle.environment.colocated_engine): its port, its index, no trainer rank;
- SIGTERM/SIGINT go to both (kubelet signals only the container's first process);
- the trainer's exit is the pod's: once it exits, the engine is stopped (it has left the weight-update group
  on training_finished); an engine that exits first is a failure of the pod (code 1 if it exited 0), and the
  trainer is stopped;
- the termination message names the process that failed (each writes its own file) and carries its message.
Output lines are prefixed `[trainer]` / `[inference]` in the pod log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

from rlkube.api.role import Role
from rlkube.contract import runtime
from rlkube.core.errors import write_termination_message
from rlkube.core.launch.ranks import Child, exit_code

log = logging.getLogger("rlkube.colocated")

STOP_GRACE_S = 15.0
"""How long the other process gets after one exited, before SIGKILL."""
TRAINER, ENGINE = Role.TRAINER, Role.INFERENCE  # the two processes of the pod
WHAT = {TRAINER: "the trainer", ENGINE: "the inference engine (colocated with the trainer)"}


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """The engine's environment from the trainer's (runtime.ENV_COLOCATED_ENGINE)."""
    plan = json.loads(env[runtime.ENV_COLOCATED_ENGINE])
    out = {k: v for k, v in env.items() if k not in set(plan["unset"])}
    out.update(plan["env"])
    return out


class Process(Child):
    def __init__(self, role: str, argv: list[str], env: dict[str, str], message_dir: Path):
        self.role = role
        super().__init__(role, argv, env, message_dir / f"{role}.termination-log")

    def message(self, code: int) -> str:
        return f"{WHAT[self.role]} exited {code}: {self.reported()}"


def run(env: dict[str, str] | None = None, argv: dict[str, list[str]] | None = None) -> int:
    """Start both, wait, return the pod's exit code. `argv`: each child's command (default: its role module)."""
    env = dict(os.environ if env is None else env)
    argv = argv or {role: [sys.executable, "-m", f"rlkube.core.{role}"] for role in (TRAINER, ENGINE)}
    message_dir = Path(tempfile.mkdtemp(prefix="rlkube-colocated-"))
    stopping = threading.Event()
    children: dict[int, Process] = {}

    def forward(signum, _frame):
        stopping.set()
        for c in children.values():
            c.signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    trainer_env = {k: v for k, v in env.items() if k != runtime.ENV_COLOCATED_ENGINE}
    for role, role_env in ((TRAINER, trainer_env), (ENGINE, engine_env(env))):
        child = Process(role, argv[role], role_env, message_dir)
        children[child.proc.pid] = child
    log.info("started the trainer and its colocated engine")

    running = dict(children)
    result: tuple[Process, int] | None = None  # the exit that decides the pod's
    killer: threading.Timer | None = None
    while running:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        child = running.pop(pid, None)
        if child is None:
            continue
        child.proc.returncode = code = exit_code(status)
        child.reader.join(timeout=5)
        log.info("%s exited %d", child.role, code)
        if result is None:
            # The first to exit decides, unless it is the engine stopping on a signal we passed on.
            if child.role == TRAINER or not stopping.is_set():
                result = (child, code)
            if running and not stopping.is_set():  # stopping: both have the signal, and their launcher the grace
                for other in running.values():
                    other.signal(signal.SIGTERM)
                others = list(running.values())
                killer = threading.Timer(STOP_GRACE_S, lambda: [o.signal(signal.SIGKILL) for o in others])
                killer.daemon = True
                killer.start()
    if killer is not None:
        killer.cancel()
    if result is None:  # stopped on a signal, the engine first: the trainer's exit is the pod's
        trainer = next(c for c in children.values() if c.role == TRAINER)
        result = (trainer, trainer.proc.returncode if trainer.proc.returncode is not None else 1)
    child, code = result
    if child.role == ENGINE:
        code = code or 1  # an engine that leaves before its trainer has finished is a failure
    if code != 0:
        message = child.message(code)
        log.error("%s", message)
        write_termination_message(message)
    return code


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s colocated %(levelname)s %(message)s")
    return run()


if __name__ == "__main__":
    sys.exit(main())
