"""Server processes the test session started and must have stopped by its end (checked in tests/conftest.py).

A module of its own, not conftest: tests/e2e/* have conftests too, so `from conftest import ...` is ambiguous.
"""

from __future__ import annotations

STARTED_PIDS: list[tuple[str, int]] = []


def track(name: str, pid: int) -> None:
    """Register a server process that must be gone when the session ends."""
    STARTED_PIDS.append((name, pid))
