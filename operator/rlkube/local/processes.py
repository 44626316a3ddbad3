"""Role processes of a local job: start them in their own process group, stop them SIGTERM-then-SIGKILL.

Each role runs in its own session so a Ctrl-C in the terminal reaches only the runner, which then stops the
roles in the order of docs/design.md §4.4. PR_SET_PDEATHSIG makes the kernel kill a role if the runner itself
dies without cleaning up (kill -9), so no role is ever orphaned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the runner's own cleanup still applies
        pass


@dataclass
class RoleProcess:
    role: str
    index: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    stopped_at: float | None = None
    forced: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def start(self) -> RoleProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return self

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


def stop_all(procs: list[RoleProcess], grace_seconds: float) -> None:
    """SIGTERM every process group, wait up to the grace period, SIGKILL what is left, reap everything."""
    for p in procs:
        if p.alive():
            p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for p in procs:
        if p.proc is None:
            continue
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.forced = True
            p.signal_group(signal.SIGKILL)
            p.proc.wait()
        # The group may hold helpers the role spawned; they must not outlive the stage.
        p.signal_group(signal.SIGKILL)
        p.stopped_at = time.time()


def python_module(module: str) -> list[str]:
    return [sys.executable, "-m", module]
