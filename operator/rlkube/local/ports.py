"""A free loopback TCP port: the one place that picks one, for `rlkube local`, its Redis, the benchmarks and the
tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the kernel's pick; it may be taken again before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
