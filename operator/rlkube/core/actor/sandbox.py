"""A subprocess sandbox for code-execution tools: the built-in `python` tool runs a model's snippet here.

An environment's tools run on a thread of their own (rlkube.core.actor.episodes.call_with_timeout), never on the actor's
event loop; `Sandbox.run` blocks that thread only, while the snippet runs in a child process
(rlkube.core.actor.sandbox_child) with:
- a wall timeout (the child's process group is killed), CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS),
  the size of any file it writes (RLIMIT_FSIZE, its output included) and the processes and threads of its user
  (RLIMIT_NPROC; not enforced for root), set in the child before the snippet runs;
- no network, refused in layers that work as root and in the hardened pod (uid 10001, no capabilities, read-only
  root, /tmp writable): a network namespace of its own (unshare(CLONE_NEWUSER|CLONE_NEWNET): only a loopback that
  is down) where the kernel allows an unprivileged user namespace, and in any case a Python audit hook installed
  before the snippet runs that refuses every socket.*, ctypes.* and new-process event;
- an environment of its own (nothing of the actor's: only CHILD_ENV's thread counts), `python -I` (no PYTHON*
  variables, no user site), and a fresh temporary directory as cwd
  (under $TMPDIR, /tmp: the one writable place in the pod; a sandbox server passes its own `work_root`),
  removed afterwards.

This is the in-process sandbox: it runs as the actor's user, on the actor's filesystem, in the actor's pod. With
spec.sandbox.mode `pods` the same runner runs in a sandbox pod of its own instead (rlkube.core.sandbox.server,
reached through rlkube.core.actor.sandbox_client); see docs/guide/sandbox.md for which layers each place has.

A refusal is a result, not an exception: `SandboxResult.message()` says what happened and which layer refused
("refused by the audit hook", "refused by the network namespace"), so the episode goes on with that as the tool's
answer. Each run is also counted on the current episode (rlkube.core.actor.episodes.note_tool): a refusal as a tool
error and a sandbox refusal, a snippet past its wall or CPU time as a tool timeout, past its memory or output
limit as a tool error; a snippet that merely raises is the model's error, not the tool's, and is not counted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlkube.core.actor.episodes import note_tool

CHILD = Path(__file__).with_name("sandbox_child.py")
LAYERS = ("netns", "audit")
# The child's whole environment: one thread per math library, since every thread's stack and malloc arena count
# against RLIMIT_AS (OpenBLAS starts one per core at import) and a snippet has seconds of CPU to spend anyway.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5
    memory_mb: int = 512  # address space: a bare interpreter maps ~30 MiB
    output_bytes: int = 65536  # stdout and stderr each, and any file the snippet writes
    processes: int = 64  # RLIMIT_NPROC: tasks (processes and threads) of the snippet's user

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> SandboxLimits:
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name in doc})


@dataclass
class SandboxResult:
    outcome: str  # ok | error (the snippet raised) | refused | timeout | cpu | memory | output | killed | unavailable
    stdout: str = ""
    stderr: str = ""
    refused_by: str | None = None  # "audit hook" | "network namespace"
    refused: list[str] = field(default_factory=list)  # the audit events refused
    layers: list[str] = field(default_factory=list)  # the network layers that were up
    exit_code: int | None = None
    seconds: float = 0.0
    server: str | None = None  # the sandbox server that ran it (rlkube.core.actor.sandbox_client), None in process

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> SandboxResult:
        return cls(**{f.name: doc[f.name] for f in dataclasses.fields(cls) if f.name in doc})

    def message(self) -> str:
        """The tool's answer: the snippet's output, or what stopped it."""
        out = self.stdout.rstrip()
        if self.outcome == "ok":
            return out
        why = {
            "refused": f"refused by the {self.refused_by} ({', '.join(self.refused)}): the sandbox allows no "
                       "network, no ctypes and no new processes",
            "timeout": f"killed: over its wall time limit ({self.seconds:.1f}s)",
            "cpu": "killed: over its CPU time limit",
            "memory": "stopped: over its memory limit",
            "output": "stopped: over its output limit",
            "killed": f"killed by signal {-(self.exit_code or 0)}",
            "unavailable": "the sandbox server did not answer; the snippet's outcome is unknown",
            "error": "an error",
        }[self.outcome]
        tail = self.stderr.strip().splitlines()[-1:] if self.outcome != "refused" else []
        return "\n".join(p for p in (out, f"[sandbox] {why}", *tail) if p)


def network_namespace_available() -> bool:
    """Whether this process may make a user + network namespace (tried in a throwaway child)."""
    probe = ("import ctypes,sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) != 0)")
    try:
        return subprocess.run([sys.executable, "-I", "-c", probe], env={}, timeout=30,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def count_outcome(result: SandboxResult) -> SandboxResult:
    """Count a snippet's outcome on the current episode, wherever it ran (in process or in a sandbox pod): a
    refusal as a tool error and a sandbox refusal, a time limit as a tool timeout, any other limit or a sandbox
    that did not answer as a tool error."""
    if result.outcome == "refused":
        note_tool("tool_errors", "sandbox_refusals")
    elif result.outcome in ("timeout", "cpu"):
        note_tool("tool_timeouts")
    elif result.outcome in ("memory", "output", "killed", "unavailable"):
        note_tool("tool_errors")
    return result


class Sandbox:
    """Runs Python snippets under `limits`; `layers` picks the network layers (both by default; a test turns one
    off to show the other refuses on its own)."""

    def __init__(self, limits: SandboxLimits | None = None, layers: tuple[str, ...] = LAYERS,
                 python: str = sys.executable, work_root: str | None = None):
        unknown = set(layers) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown sandbox layers {sorted(unknown)} (known: {LAYERS})")
        self.limits = limits or SandboxLimits()
        self.layers = tuple(layers)
        self.python = python
        self.work_root = work_root  # where each snippet's fresh directory is made (default: $TMPDIR)
        self._child = CHILD.read_text()

    def run(self, code: str) -> SandboxResult:
        """Run `code` to its end or its limits; blocks the calling thread (a tool's), never raises for the
        snippet's behaviour. Counted on the current episode (rlkube.core.actor.episodes.note_tool)."""
        return count_outcome(self._run(code))

    def python_tool(self, code: str) -> str:
        """The built-in `python` tool: the snippet's output, or what stopped it, as the tool message's text."""
        return self.run(code).message()

    def _run(self, code: str) -> SandboxResult:
        lim = self.limits
        work = tempfile.mkdtemp(prefix="rlkube-sandbox-", dir=self.work_root)
        try:
            cwd = os.path.join(work, "cwd")
            os.mkdir(cwd, 0o700)
            out_path, err_path = os.path.join(work, "stdout"), os.path.join(work, "stderr")
            status_r, status_w = os.pipe()
            config = {"status_fd": status_w, "layers": list(self.layers), "cpu_seconds": max(1, int(lim.cpu_s)),
                      "memory_bytes": lim.memory_mb * 2 ** 20, "file_bytes": lim.output_bytes,
                      "processes": lim.processes}
            start = time.monotonic()
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                try:
                    child = subprocess.Popen([self.python, "-I", "-c", self._child, json.dumps(config)],
                                             stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=cwd, env=CHILD_ENV,
                                             pass_fds=(status_w,), start_new_session=True, close_fds=True)
                except BaseException:
                    os.close(status_r)
                    raise
                finally:
                    os.close(status_w)
                timed_out = False
                try:
                    child.communicate(code.encode(), timeout=lim.timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    _kill_group(child)
                    child.wait()
                finally:
                    _kill_group(child)  # and whatever it left behind in its group
            seconds = time.monotonic() - start
            raw = _drain(status_r)  # written before the child exited; not waiting on a leftover holding the pipe
            try:
                status = json.loads(raw) if raw else {}
            except ValueError:
                status = {}
            result = SandboxResult(outcome="ok", stdout=_read(out_path, lim.output_bytes),
                                   stderr=_read(err_path, lim.output_bytes), layers=status.get("layers", []),
                                   exit_code=status.get("exit_code", child.returncode), seconds=seconds)
            _judge(result, status, timed_out, child.returncode)
            return result
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _judge(result: SandboxResult, status: dict, timed_out: bool, returncode: int) -> None:
    if status.get("refused"):
        result.outcome, result.refused_by, result.refused = "refused", "audit hook", list(status["refused"])
    elif status.get("netns_refused"):
        result.outcome, result.refused_by = "refused", "network namespace"
        result.refused = [status["netns_refused"]]
    elif timed_out:
        result.outcome = "timeout"
    elif returncode == -signal.SIGXCPU and not status:
        result.outcome = "cpu"  # at the soft limit; a snippet that handles SIGXCPU is killed at the hard one
    elif not status:
        result.outcome = "killed"
    elif status.get("outcome") in ("memory", "output"):
        result.outcome = status["outcome"]
    elif status.get("outcome") == "error" or result.exit_code not in (0, None):
        result.outcome = "error"


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks)


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")
