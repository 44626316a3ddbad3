"""The sandbox's child side (rlkube.core.actor.sandbox): run as `python -I -c <this file's source> <config>`, never
imported by rlkube, so it imports nothing of it and runs before any user code.

In order: leave the network (a new user + network namespace where the kernel allows an unprivileged one: only a
loopback that is down, so nothing is reachable) and give up the capabilities the new user namespace grants, set the
resource limits, install the audit hook that refuses sockets, ctypes and new processes, then read the snippet from
stdin and run it. The outcome goes to the status fd as one JSON object, written by this process alone (a snippet's
forked children exit without one); the parent reads a missing one as a killed child.

Why the capabilities go: a task that holds CAP_SYS_ADMIN or CAP_SYS_RESOURCE in its own user namespace is exempt
from RLIMIT_NPROC under gVisor before release 20260112 (the sandbox pods' kernel, docs/guide/sandbox.md), so a fork
loop there ran until its wall limit. Linux checks the initial namespace and was never affected.
"""

import ctypes
import errno
import json
import os
import resource
import socket
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS = 38
LINUX_CAPABILITY_VERSION_3 = 0x20080522  # linux/capability.h: two 32-bit data words per set
# Audit events (docs.python.org "Audit events table") that reach the network or leave this interpreter: a new
# process or foreign code via ctypes would run without the hook.
REFUSED_PREFIXES = ("socket.", "ctypes.")
REFUSED_EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "pty.spawn", "_posixsubprocess.fork_exec"}
# What a socket meets in a namespace with no network: no route, no address, no name resolution.
NETNS_ERRNOS = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL, socket.EAI_AGAIN, socket.EAI_NONAME}


class SandboxRefused(PermissionError):
    pass


def _leave_network() -> str | None:
    """None when this process is now in a network namespace of its own, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        return None
    return os.strerror(ctypes.get_errno())


def _drop_capabilities() -> str | None:
    """None when this process now holds no capability and can gain none (no_new_privs), else why not. After
    unshare(CLONE_NEWUSER) it holds every capability in its new namespace; no uid map is written, so none returns."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"no_new_privs: {os.strerror(ctypes.get_errno())}"
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, twice: all empty
    if libc.capset(header, data) != 0:
        return f"capset: {os.strerror(ctypes.get_errno())}"
    return None


def main() -> None:
    config = json.loads(sys.argv[1])
    status_fd = config["status_fd"]
    me = os.getpid()
    status: dict = {"layers": []}
    if "netns" in config["layers"]:
        why = _leave_network()
        if why is None:
            status["layers"].append("netns")
            kept = _drop_capabilities()
            if kept is not None:  # the namespace's capabilities would lift RLIMIT_NPROC under gVisor
                status["capabilities_kept"] = kept
        else:
            status["netns_unavailable"] = why
    for name, value in (("RLIMIT_AS", config["memory_bytes"]), ("RLIMIT_FSIZE", config["file_bytes"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (config["cpu_seconds"], config["cpu_seconds"] + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if config.get("processes"):
        resource.setrlimit(resource.RLIMIT_NPROC, (config["processes"], config["processes"]))
    code = sys.stdin.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    refusals: list[str] = []

    if "audit" in config["layers"]:
        def hook(event: str, args: tuple) -> None:
            if event.startswith(REFUSED_PREFIXES) or event in REFUSED_EVENTS:
                refusals.append(event)
                raise SandboxRefused(f"sandbox: {event} refused (audit hook: no network, no ctypes, no new processes)")

        sys.addaudithook(hook)
        status["layers"].append("audit")

    outcome = "ok"
    try:
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        status["exit_code"] = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except MemoryError:
        outcome = "memory"
        status["error"] = "MemoryError"
        sys.stderr.write(f"MemoryError: the snippet went past the sandbox's memory limit "
                         f"({config['memory_bytes'] // 2 ** 20} MiB)\n")
    except BaseException as exc:  # noqa: BLE001 - the snippet's error is its result
        outcome = "output" if isinstance(exc, OSError) and exc.errno == errno.EFBIG else "error"
        status["error"] = type(exc).__name__
        if (isinstance(exc, OSError) and "netns" in status["layers"] and exc.errno in NETNS_ERRNOS
                and not isinstance(exc, SandboxRefused)):
            status["netns_refused"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(limit=-3)
    if refusals:
        status["refused"] = refusals
    status["outcome"] = outcome
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass
    if os.getpid() != me:  # a child the snippet forked: its parent's status is the one
        os._exit(0)
    os.write(status_fd, json.dumps(status).encode())
    os.close(status_fd)
    os._exit(0)


if __name__ == "__main__":
    main()
