"""What one trainer event says about the job's progress: the one reading of the event payloads.

The operator folds these facts into `status.trainer` (and `status.completion`), `rlkube local` into its progress
bar and summary. Only this module knows which payload field carries what (a weights_ready's `version` falls back
to its `step`, a checkpoint path comes as `path` or `checkpoint`; a metrics event is read through the trainer's
own record, rlkube.contract.step_metrics; an evaluation's weight version and mean reward as `version` and
`reward_mean`; the agent and evaluation counters by their types, rlkube.contract.counters), so the two launchers
cannot read the same event differently. Unknown types carry no facts. An `evaluation` comes from actor 0, not the
trainer (spec.evaluation): `from_trainer` is False, so it never counts as the trainer being alive (the stall rule,
docs/design.md §4.3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from rlkube.contract import counters, protocol
from rlkube.contract.step_metrics import StepMetrics


MAX_PATH = 4096
"""Longest checkpoint path taken from an event (Linux's PATH_MAX): a longer string is no path, and the status that
records it must stay small enough for the API server to store."""


TRACKER_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""A tracker's name in a tracker_failed event (mlflow, wandb, tensorboard); anything else is no fact."""
MAX_MESSAGE = 1000
"""Longest tracker failure message kept (the condition holds every failed tracker's)."""


def _int(value: Any) -> int | None:
    return protocol.as_int64(value)


def _float(value: Any, digits: int) -> float | None:
    """A finite number, rounded: a status field and a printer column, not a metric's full precision (NaN and
    infinities are not JSON and are dropped)."""
    number = protocol.as_finite_float(value)
    return None if number is None else round(number, digits)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and 0 < len(value) <= MAX_PATH else None


@dataclass(frozen=True)
class Facts:
    step: int | None = None
    weights_version: int | None = None
    documents_seen: int | None = None
    lag: int | None = None
    checkpoint: tuple[int, str] | None = None
    """(step, path) of a checkpoint the event reports as saved."""
    finished: bool = False
    interrupted: bool = False
    """A training_finished of a scheduled or interrupted stop (the payload says so)."""
    reward_mean: float | None = None
    """Mean reward of the step's training documents (4 decimals)."""
    tokens_per_s: float | None = None
    """Tokens the trainer consumed per second of the step's wall time (1 decimal)."""
    metrics: dict[str, Any] | None = None
    evaluation: tuple[int, float] | None = None
    """(weight version, mean reward over the eval set, 4 decimals) of an evaluation event."""
    evaluation_payload: dict[str, Any] | None = None
    evaluation_counts: dict[str, int | float] | None = None
    """An evaluation's numbers for the status (rlkube.contract.counters.EVALUATION_STATUS), typed by their counters."""
    agent: dict[str, int | float] | None = None
    """The agent counters of a metrics event for the status (rlkube.contract.counters.AGENT_STATUS: whole-job episode
    totals, the step's turn_reward_mean), typed by their counters; None for single-turn jobs."""
    tracker_failure: tuple[str, str] | None = None
    """(tracker, message) of a tracker_failed event (spec.tracking)."""
    from_trainer: bool = True


def read(ev: protocol.TrainerEvent) -> Facts:
    payload, step = ev.payload, ev.step
    if ev.type == protocol.WEIGHTS_READY:
        version = _int(payload.get("version"))
        return Facts(step=step, weights_version=version if version is not None else step,
                     documents_seen=_int(payload.get("documents_seen")))
    if ev.type == protocol.METRICS:
        m = StepMetrics.read(payload)
        return Facts(step=step, lag=m.lag_max, reward_mean=_float(m.reward_mean, 4),
                     tokens_per_s=_float(m.tokens_per_s, 1), metrics=payload, agent=counters.agent_status(payload))
    if ev.type == protocol.CHECKPOINT_SAVED:
        path = _str(payload.get("path")) or _str(payload.get("checkpoint"))
        return Facts(checkpoint=(step, path) if step is not None and path else None)
    if ev.type == protocol.TRAINING_FINISHED:
        path = _str(payload.get("checkpoint"))
        # A `step` that is there but no int64 number is no evidence of the final step: without this the job
        # would be judged on the last weights_ready step as if the field were absent (Fast-LLM sends none).
        garbled = "step" in payload and step is None
        return Facts(step=step, checkpoint=(step, path) if step is not None and path else None, finished=True,
                     interrupted=bool(payload.get("interrupted")) or garbled)
    if ev.type == protocol.EVALUATION:
        version, reward = _int(payload.get("version")), _float(payload.get("reward_mean"), 4)
        return Facts(evaluation=(version, reward) if version is not None and reward is not None else None,
                     evaluation_payload=payload, evaluation_counts=counters.evaluation_status(payload),
                     from_trainer=False)
    if ev.type == protocol.TRACKER_FAILED:
        tracker, message = payload.get("tracker"), payload.get("message")
        if not isinstance(tracker, str) or not TRACKER_NAME.fullmatch(tracker):
            return Facts()
        text = message[:MAX_MESSAGE] if isinstance(message, str) else ""
        return Facts(tracker_failure=(tracker, text))
    return Facts()


def fold_agent(previous: dict[str, int | float] | None, new: dict[str, int | float] | None
               ) -> dict[str, int | float] | None:
    """The agent counters to show after a metrics event (`status.agent`, `rlkube local`): the event's over the
    previous ones, so a step without rewarded turns keeps the last turn_reward_mean."""
    if new is None:
        return previous
    return {**(previous or {}), **new}
