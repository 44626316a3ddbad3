"""The trainer's `metrics` event for one step as a typed record: the trainer builds one (core/trainer/reporting.py)
and sends its flat payload; lifecycle/progress.py reads any metrics payload back into one. One set of field names
for both ends, so a renamed field breaks the writer's and the reader's tests together instead of leaving the
operator's status silently empty (docs/design.md §5.2).

The wire format is the flat JSON object it always was (metrics.jsonl of `rlkube local`, the trackers' `train/`
series): the typed fields first, then the optional counters in `extra`. A reader takes only what is well-formed:
an absent or garbled field is None, never an exception, since the events stream also carries other trainers'
events (Fast-LLM's, older rlkube versions', whose worst lag is `lag`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlkube.contract import protocol

LEGACY_LAG = "lag"
"""The worst lag's name in an older trainer's metrics (read when `lag_max` is absent)."""


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One training step, as rank 0 reports it (every rank's documents counted). None: not reported (a reader) or
    not measured (the writer: `entropy` when the backend does not compute it)."""

    step: int | None = None
    version: int | None = None
    """The weight version after the step."""
    loss: float | None = None
    reward_mean: float | None = None
    """Mean reward of the step's training documents."""
    reward_errors: int | None = None
    """Samples whose reward function failed (scored 0)."""
    lag_max: int | None = None
    """The step's worst lag: the trainer's version minus the oldest weight version a document was sampled with."""
    stale_documents: int | None = None
    """Documents over spec.algorithm.maxLag."""
    tokens: int | None = None
    loss_tokens: int | None = None
    tokens_per_s: float | None = None
    """Tokens consumed per second of the step's wall time (wait + busy + publish)."""
    busy_s: float | None = None
    wait_s: float | None = None
    publish_s: float | None = None
    ratio_mean: float | None = None
    clipped_fraction: float | None = None
    kl: float | None = None
    entropy: float | None = None
    grad_norm: float | None = None
    learning_rate: float | None = None
    documents_seen: int | None = None
    documents_skipped: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """The counters only some jobs have, under their own names: trainer vs sampler log-probs and the reference KL,
    zero-advantage groups filtered, the agent's `episode_*` totals and per-episode rates."""

    def payload(self) -> dict[str, Any]:
        """The event's fields after `type`: every typed field (entropy may be null), then `extra`."""
        out = {f.name: getattr(self, f.name) for f in _TYPED}
        clash = out.keys() & self.extra.keys()
        if clash:
            raise ValueError(f"extra metrics {sorted(clash)} shadow typed fields")
        return {**out, **self.extra}

    @classmethod
    def read(cls, payload: Mapping[str, Any]) -> StepMetrics:
        """The well-formed fields of any metrics payload: ints must be int64 numbers, floats finite numbers; the
        rest of the payload's numbers go to `extra`."""
        values: dict[str, Any] = {}
        for f in _TYPED:
            raw = payload.get(f.name)
            if f.name == "lag_max" and raw is None:
                raw = payload.get(LEGACY_LAG)
            values[f.name] = protocol.as_int64(raw) if f.name in _INTS else protocol.as_finite_float(raw)
        extra = {k: v for k, v in payload.items()
                 if k not in values and k not in ("type", LEGACY_LAG) and protocol.as_finite_float(v) is not None}
        return cls(**values, extra=extra)


_TYPED = tuple(f for f in dataclasses.fields(StepMetrics) if f.name != "extra")
_INTS = frozenset(f.name for f in _TYPED if f.type == "int | None")
"""The integer fields, read from their annotations (strings: `from __future__ import annotations`)."""
