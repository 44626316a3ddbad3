"""A free loopback TCP port: the one place that picks one, for `rlkube local`, its Redis, the benchmarks and the
tests.

Why not the kernel's pick (bind to port 0): that port comes from the ephemeral range, the same range every
outgoing connection on the machine takes its source port from, and every caller here binds its port seconds later
(a trainer's TCPStore after importing torch and megatron-core, a Redis server, an inference server). Under load an
outgoing connection took such a port in between, and the trainer rank failed with EADDRINUSE and was restarted.
Below the ephemeral range only another explicit bind can take it. A port is also never handed out twice by one
process, since none is bound yet when the next is asked for.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# The lowest port picked: above the well-known and the common registered servers' ports.
LOWEST = 10000

_handed_out: set[int] = set()
_lock = threading.Lock()


def ephemeral_low() -> int | None:
    """The first port of Linux's ephemeral range (None where there is no /proc to say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, below the ephemeral range where there is room, and not one this
    process handed out before."""
    low = ephemeral_low()
    with _lock:
        if low is not None and low - LOWEST >= 1000:
            for _ in range(500):
                port = random.randrange(LOWEST, low)
                if port not in _handed_out and _bindable(port):
                    _handed_out.add(port)
                    return port
        # No room below the range (or no /proc): the kernel's pick.
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
