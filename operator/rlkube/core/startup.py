"""What every role process's main() does before its loop: log lines tagged with the role's name, and SIGTERM/SIGINT
turned into a stop event that the loop checks, so a stopping role finishes what it owes (a step, a checkpoint,
training_finished) and exits on its own instead of dying in the middle of a write."""

from __future__ import annotations

import logging
import signal
import threading


def stop_on_signals(role: str, log: logging.Logger, stopping: str = "stopping") -> threading.Event:
    """Configure logging for `role` and return the event SIGTERM and SIGINT set (logged as `stopping`)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: %s", signum, stopping)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return stop
