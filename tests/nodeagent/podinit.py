"""The first code that runs in a pod: enter the pod's network namespace, make a private mount and UTS
namespace, bind-mount the volumes, /etc/hosts and /etc/resolv.conf, set the hostname, then exec the
container's command.

Why a separate program: these steps must happen in the child between fork and exec, and doing them in a
`preexec_fn` of the multi-threaded agent is unsafe. The agent starts `python -S podinit.py CONFIG` with
`start_new_session=True`; this file execs the container, so the pid the agent holds IS the container's
main process and its process group is the container's. Standard library only (`-S` skips site-packages:
fast start).

CONFIG is a JSON file: {"netns": path|null, "hostname": str, "mounts": [{"source", "target", "readOnly"}],
"cwd": str (workingDir, in the container's view) or "hostCwd": str (a host directory), "argv": [...],
"env": {...}, "startError": path, "hostPaths": [path, ...]}. `hostPaths` are the host directories the pod's
processes run from, as an image's own files would be (the checkout, its virtual environments, PYTHONPATH: the
agent runs no images): a volume mounted over one of them (an emptyDir at /tmp while the checkout is under /tmp)
must not hide it, so each one a volume covered is bound back at its own path, on top of that volume. On a failure before exec it writes the reason
to `startError` and exits 128 (what kubelet reports for a container that could not start).
"""

import ctypes
import json
import os
import signal
import socket
import stat
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
O_PATH = 0o10000000

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source else None
    _check(libc.mount(src, target.encode(), None, ctypes.c_ulong(flags), None), f"mount {source} -> {target}")


def _same(path: str, fd: int) -> bool:
    """Whether `path` still shows the directory `fd` was opened on (no mount covers it)."""
    try:
        here, there = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def enter(cfg: dict) -> None:
    # The pod dies with the agent's thread that started it: a killed agent leaves no orphans behind.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])  # a container starts with no signal blocked
    if cfg.get("netns"):
        fd = os.open(cfg["netns"], os.O_RDONLY)
        _check(libc.setns(fd, CLONE_NEWNET), f"setns {cfg['netns']}")
        os.close(fd)
    _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(mount, uts)")
    # Private propagation: our binds must not leak back to the host's mount namespace.
    _mount(None, "/", MS_REC | MS_PRIVATE)
    # The agent's work directory for the pod is a host path: held open across the mounts below, like the sources.
    host_cwd = os.open(cfg["hostCwd"], os.O_RDONLY | os.O_DIRECTORY) if cfg.get("hostCwd") else None
    mounts = cfg.get("mounts", [])
    # Every source is opened before the first bind: a volume mounted over a directory that holds other sources
    # (an emptyDir at /tmp while the pod directory lives under /tmp) must not hide them, as a container runtime
    # resolves sources on the host, not in the container's view.
    sources = [os.open(m["source"], O_PATH) for m in mounts]
    kept = [(p, os.open(p, O_PATH)) for p in sorted(cfg.get("hostPaths", []), key=len) if os.path.isdir(p)]
    for m, fd in zip(mounts, sources):
        if not os.path.exists(m["target"]):
            # A mount point that is not there in the pod's view (a file such as /dev/termination-log, or a path
            # under an earlier volume): make it, as a container runtime does in the container's root filesystem.
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.makedirs(os.path.dirname(m["target"]), exist_ok=True)
                open(m["target"], "a").close()
            else:
                os.makedirs(m["target"], exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", m["target"], MS_BIND | MS_REC)
        if m.get("readOnly"):
            _mount(None, m["target"], MS_REMOUNT | MS_BIND | MS_RDONLY)
    for fd in sources:
        os.close(fd)
    for path, fd in kept:
        if not _same(path, fd):
            os.makedirs(path, exist_ok=True)  # inside the volume that covers it, in this namespace's view only
            _mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC)
        os.close(fd)
    if cfg.get("hostname"):
        socket.sethostname(cfg["hostname"])
    if host_cwd is not None:
        os.fchdir(host_cwd)
        os.close(host_cwd)
    else:
        os.chdir(cfg.get("cwd") or "/")  # workingDir: a path in the container's view


def main() -> None:
    with open(sys.argv[1]) as fh:
        cfg = json.load(fh)
    argv = cfg["argv"]
    # Where the agent looks for a start error, opened now: a volume may cover its path once mounted (/tmp).
    error_dir = os.open(os.path.dirname(cfg["startError"]), os.O_RDONLY | os.O_DIRECTORY)
    try:
        enter(cfg)
        os.execvpe(argv[0], argv, cfg["env"])
    except OSError as exc:
        message = f"failed to start container command {argv[0]!r}: {exc}"
        print(message, file=sys.stderr, flush=True)
        try:
            fd = os.open(os.path.basename(cfg["startError"]), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644,
                         dir_fd=error_dir)
            with os.fdopen(fd, "w") as fh:
                fh.write(message)
        except OSError:
            pass
        os._exit(128)


if __name__ == "__main__":
    main()
