"""The servers `rlkube bench operator` runs as subprocesses (the operator, kube-controller-manager): started in
a session of their own with their output in a log file, measured from /proc, and stopped with nothing left.

The same way tests/cluster/control_plane.py runs etcd and kube-apiserver: a process group per server, so a
Ctrl-C reaches the bench (which decides the order things stop in), and SIGTERM, then SIGKILL, for the group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log_path, "wb") as logf:  # the child keeps its own descriptor
        return subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def log_tail(log_path: Path, chars: int = 2000) -> str:
    try:
        return log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM to the process group of `proc` (started with start_new_session), SIGKILL after `timeout` s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a live process, from /proc (Linux, where the operator runs)."""
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kib = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1))
    # Fields after the parenthesised command name: utime and stime are the 12th and 13th (clock ticks).
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return peak_kib / 1024, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CONTROL_PLANE = ("kube-apiserver", "etcd", "kube-controller")  # /proc/PID/comm is cut at 15 characters


def cpu_by_name(names: tuple[str, ...] = CONTROL_PLANE) -> dict[str, float]:
    """CPU seconds so far of the local processes with these command names, summed per name (empty where the
    cluster runs elsewhere): what the API server and etcd spent, to set beside what a controller cost them."""
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            if comm in names:
                out[comm] = out.get(comm, 0.0) + usage(int(proc.name))[1]
        except (OSError, AttributeError):  # gone meanwhile, or a kernel thread without VmHWM
            continue
    return out
