"""How a role process reports a fatal error to its launcher: a termination message and an exit code.

Kubernetes copies what a container wrote to its terminationMessagePath (/dev/termination-log) into the pod's
status; the operator puts it in the job's Failed condition. `rlkube local` points the same path at a file per
process. An input that cannot work (a missing model directory, an unsupported architecture, a dataset without
the mapped field) is a `ConfigError` naming the spec field: the role exits with runtime.EXIT_CONFIG and the job
fails at once instead of restarting a process that can never start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from rlkube.contract import runtime

log = logging.getLogger(__name__)

MAX_MESSAGE = 4096
"""Kubernetes keeps at most 4096 bytes of a termination message."""


class ConfigError(Exception):
    """The job's input cannot work; `field` is the spec path to fix (e.g. `spec.model.path`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def write_termination_message(text: str) -> None:
    path = os.environ.get(runtime.ENV_TERMINATION_LOG, runtime.TERMINATION_LOG)
    try:
        with open(path, "w") as fh:
            fh.write(text.encode()[-MAX_MESSAGE:].decode(errors="ignore"))
    except OSError:  # no such path outside a pod (a plain `python -m`): the log line below still says it
        pass


def run_role(main: Callable[[], int]) -> int:
    """Run a role's main(); a fatal error leaves its message where the launcher reads it."""
    try:
        return main()
    except ConfigError as exc:
        log.error("invalid input: %s", exc)
        write_termination_message(str(exc))
        return runtime.EXIT_CONFIG
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        log.exception("fatal error")
        write_termination_message(f"{type(exc).__name__}: {exc}")
        return 1
