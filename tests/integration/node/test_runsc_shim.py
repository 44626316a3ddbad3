"""A pod's app container runs under gVisor through containerd's runc shim and Debian's runsc (the test node's `runsc`
handler, tests/cluster/node.py RUNSC_WRAPPER), shown with containerd alone, no kubelet:

A containerd of its own and `ctr` make what the CRI plugin makes of a pod: a pause container (annotated as a pod
sandbox, so runsc boots a sandbox for it) and an app container annotated with that sandbox's id (so runsc starts
it as a subcontainer of the same sandbox, in the same shim). The app container starts, its output reaches its
stdio (`ctr run` attached), it runs on gVisor's kernel and not this machine's, and its exit status reaches
containerd (7), while the pod runs on; the pod's task, killed, can then be deleted. Without the wrapper the shim never
returned from starting the app container, and a stopped pod's task could not be deleted (docs/guide/sandbox.md,
"gVisor on a node"). Needs root, containerd and runsc; run it under the machine lock, as any test of the node.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from cluster.control_plane import spawn, stop_group, wait_ready
from cluster.node import RUNSC_WRAPPER
from support.waiting import wait_for

RUNSC = shutil.which("runsc")
pytestmark = pytest.mark.skipif(RUNSC is None or shutil.which("containerd") is None or os.geteuid() != 0,
                                reason="needs root, containerd and runsc (Debian's gVisor)")


def _rootfs(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    for d in ("proc", "dev", "sys", "tmp", "etc"):
        (path / d).mkdir()
    shutil.copy("/bin/busybox", path / "bin" / "busybox")
    for tool in ("sh", "sleep", "cat"):
        (path / "bin" / tool).symlink_to("busybox")
    return path


@pytest.fixture
def containerd(tmp_path):
    sock = tmp_path / "containerd.sock"
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\nroot = "{tmp_path / "root"}"\nstate = "{tmp_path / "state"}"\n'
                      f'[grpc]\n  address = "{sock}"\n[ttrpc]\n  address = "{tmp_path / "ttrpc.sock"}"\n'
                      '[debug]\n  address = ""\n[metrics]\n  address = ""\n')
    proc = spawn(tmp_path, "containerd", ["containerd", "--config", str(config)])
    namespace = f"rlkube-runsc-{uuid.uuid4().hex[:8]}"
    ctr = ["ctr", "--address", str(sock), "--namespace", namespace]
    try:
        wait_ready(proc, tmp_path / "containerd.log",
                   lambda: subprocess.run([*ctr, "version"], capture_output=True).returncode == 0, 30)
        yield ctr
    finally:
        for task in ("app", "pod"):
            for argv in (["task", "kill", "-s", "9", task], ["task", "rm", "-f", task], ["container", "rm", task]):
                try:
                    subprocess.run([*ctr, *argv], capture_output=True, timeout=30)
                except subprocess.TimeoutExpired:
                    pass  # a shim that hangs (the failure this test is for): ended below
        stop_group(proc)
        _end_leftovers(namespace)
        shutil.rmtree(Path("/run/containerd/runc") / namespace, ignore_errors=True)  # the shim's runsc root


def _end_leftovers(namespace: str) -> None:
    """SIGKILL this test's shim and runsc processes still alive (each names the test's own namespace)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and any(namespace.encode() in a for a in argv):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_pods_app_container_starts_in_the_pause_containers_gvisor_sandbox_and_its_exit_status_reaches_containerd(
        containerd, tmp_path):
    wrapper = tmp_path / "runsc"
    wrapper.write_text(RUNSC_WRAPPER.replace("@RUNSC@", RUNSC))
    wrapper.chmod(0o755)
    run = [*containerd, "run", "--rootfs", "--runc-binary", str(wrapper),
           "--annotation", "io.kubernetes.cri.sandbox-id=pod"]
    subprocess.run([*run, "-d", "--annotation", "io.kubernetes.cri.container-type=sandbox",
                    str(_rootfs(tmp_path / "pause")), "pod", "/bin/sleep", "600"], check=True, timeout=60)

    app = subprocess.run([*run, "--annotation", "io.kubernetes.cri.container-type=container",
                          str(_rootfs(tmp_path / "app")), "app", "/bin/sh", "-c",
                          "echo app-started; cat /proc/version; echo to-stderr >&2; exit 7"],
                         capture_output=True, text=True, timeout=60)
    assert app.returncode == 7, (app.returncode, app.stdout, app.stderr)
    lines = app.stdout.splitlines()
    assert lines[0] == "app-started", app.stdout
    # gVisor's sentry answered `cat /proc/version`, not this machine's kernel.
    assert lines[1] != Path("/proc/version").read_text().strip() and lines[1].startswith("Linux version"), lines
    assert "to-stderr" in app.stderr, app.stderr
    assert _state(containerd, "pod") == "RUNNING"  # the app container's end is not its pod's

    # The pod's end, as the CRI plugin stops a pod: SIGKILL, then delete, which kills once more a sandbox that is
    # gone; the runtime must call that "not running" for the shim to let the task go.
    subprocess.run([*containerd, "task", "kill", "-s", "9", "pod"], check=True, timeout=30)
    wait_for(lambda: _state(containerd, "pod") == "STOPPED", 30, "the pod's task to stop")
    gone = subprocess.run([*containerd, "task", "rm", "-f", "pod"], capture_output=True, text=True, timeout=30)
    assert gone.returncode == 0, gone.stderr
    assert _state(containerd, "pod") is None


def _state(ctr: list[str], task: str) -> str | None:
    tasks = subprocess.run([*ctr, "task", "ls"], capture_output=True, text=True, check=True).stdout
    return next((line.split()[2] for line in tasks.splitlines()[1:] if line.split()[0] == task), None)
