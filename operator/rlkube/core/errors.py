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
import sys
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


def role_help(main: Callable[[], int]) -> str:
    """`python -m rlkube.core.<role> --help`: what the role is and the environment it reads (it takes no arguments)."""
    module = sys.modules.get(main.__module__)
    spec = getattr(module, "__spec__", None)
    name = spec.name if spec else main.__module__  # under `python -m` the module is __main__
    if name.endswith(".__main__"):  # `python -m <package>`: the package names and describes the role
        name = name.removesuffix(".__main__")
        module = sys.modules.get(name, module)
    env = sorted(v for k, v in vars(runtime).items() if k.startswith("ENV_") and isinstance(v, str))
    return (f"usage: python -m {name}\n\n{(getattr(module, '__doc__', None) or '').strip()}\n\n"
            "Arguments: none. The launcher (the operator's pod, or `rlkube local`) configures the role through "
            f"the environment: {', '.join(env)}.\n")


def run_role(main: Callable[[], int]) -> int:
    """Run a role's main(); a fatal error leaves its message where the launcher reads it."""
    # A role takes no arguments; `--help` answers without a job (an image's smoke check runs it so).
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(role_help(main))
        return 0
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
