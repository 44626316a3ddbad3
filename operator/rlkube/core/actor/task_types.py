"""The types a task is made of, shared by the task loader and the task sources it loads.

`rlkube.core.actor.tasks` builds a job's task from a dataset (`rlkube.core.actor.prompt_dataset`), with a reward from
`spec.task.reward` (`rlkube.core.actor.rewards`); those two need the prompt type, the task error and the entry-point
import as much as the loader does. They live here, below all three, so the loader can import its sources without
an import circle (tests/unit/test_layering.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlkube.core.errors import ConfigError


class TaskError(ConfigError, ValueError):
    """The job's task cannot be built or used as specified; `field` is the spec field to fix. A ConfigError: the
    actor exits with runtime.EXIT_CONFIG and `str(error)` (`"spec.task.dataset.promptField: ..."`) as its
    termination message, and the job fails instead of restarting it (rlkube.core.errors)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.message = message


Message = dict[str, str]


@dataclass(frozen=True)
class Prompt:
    """One prompt: plain `text`, or chat `messages` ([{role, content}, ...]; then `text` is only for logs).
    `meta` carries whatever `reward` needs: `answer` (the reference answer) and, for dataset tasks, `sample`
    (the dataset row)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    messages: Sequence[Message] | None = None


def import_attribute(entry_point: str, spec_field: str) -> Any:
    """`package.module:attribute` imported; TaskError naming `spec_field` when it cannot be."""
    module_name, _, attr = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(spec_field, f"cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise TaskError(spec_field, f"module {module_name!r} has no attribute {attr!r}") from None
