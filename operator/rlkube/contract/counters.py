"""The agent and evaluation counters: each one's name and type (integer or float), written down once.

Why this module: the actors add their episodes' counts to one Redis hash, with HINCRBY for an integer and
HINCRBYFLOAT for a float, and Redis refuses HINCRBY on a field a float was added to. So the command must follow
from the counter's name, never from the Python type a value happens to have (a group whose episodes earned no
per-turn reward sums to the int 0). Every writer and reader of these counters takes the type from here: the actors'
write script (rlkube.core.actor.lag), the trainer's metrics (rlkube.core.trainer.role), and the one reading of
the metrics and evaluation events that the operator's status and Prometheus gauges and `rlkube local` share
(`agent_status`, `evaluation_status`, used by rlkube.lifecycle.progress). docs/design.md §5.3;
docs/guide/agent-counters.md lists them for users.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlkube.contract import protocol

Number = int | float


@dataclass(frozen=True)
class Counter:
    name: str
    type: type[int] | type[float]
    help: str

    def parse(self, value: Any) -> Number | None:
        """`value` as this counter's type, or None when it is no such number (a bool, text, NaN, a fraction for an
        integer counter): a reader skips what it cannot read rather than reporting a made-up value."""
        if isinstance(value, bytes):
            value = value.decode()
        if isinstance(value, str):
            try:
                value = int(value) if self.type is int else float(value)
            except ValueError:
                return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if self.type is int:
            if isinstance(value, float) and not value.is_integer():  # NaN and infinities included
                return None
            return protocol.as_int64(value)  # what a Kubernetes integer field holds
        return protocol.as_finite_float(value)


def _table(*counters: Counter) -> dict[str, Counter]:
    return {c.name: c for c in counters}


EPISODE: dict[str, Counter] = _table(
    Counter("episodes", int, "multi-turn episodes written to the rollouts"),
    Counter("turns", int, "the model's replies"),
    Counter("tool_calls", int, "environment answers (each `respond` that returned messages)"),
    Counter("tool_errors", int, "episodes ended by the environment's code raising (sandbox refusals included)"),
    Counter("tool_timeouts", int, "episodes ended by an answer past toolTimeoutSeconds"),
    Counter("sandbox_refusals", int, "snippets the sandbox refused (no network)"),
    Counter("truncated", int, "episodes cut by maxTurns or maxEpisodeTokens"),
    Counter("timed_out", int, "episodes cut by episodeTimeoutSeconds"),
    Counter("drifted", int, "episodes whose conversation re-renders to other token ids than those sampled"),
    Counter("turn_rewards", int, "turns the environment rewarded (`Turn(messages, reward=...)`)"),
    Counter("turn_reward_sum", float, "the sum of those per-turn rewards"),
)
"""The actors' episode counts, whole job: the fields of the hash StreamKeys.episodes (docs/design.md §5.1)."""

EVALUATION: dict[str, Counter] = _table(
    Counter("reward_mean", float, "mean reward over the eval prompts scored"),
    Counter("prompts", int, "eval prompts scored"),
    Counter("skipped", int, "eval prompts not scored (the environment or the server failed on them)"),
    Counter("reward_errors", int, "eval samples whose reward function failed (scored 0)"),
    Counter("attempts", int, "times the eval set was sampled to score it with one weight version"),
    Counter("seconds", float, "wall time of the evaluation"),
)
"""The numbers of an `evaluation` event's payload (rlkube.core.actor.evaluation, docs/design.md §5.2)."""

METRIC_PREFIX = "episode_"
"""The trainer's metrics event reports each episode counter's whole-job total as `episode_<name>`."""

RATES: dict[str, Counter] = _table(
    Counter("turns_per_episode", float, "replies per episode since the previous step's report"),
    Counter("tool_calls_per_episode", float, "tool calls per episode since the previous step's report"),
    Counter("turn_reward_mean", float, "mean per-turn reward over the turns rewarded since the previous step's "
            "report (absent when none was)"),
)
"""What the trainer's metrics derive from the totals, per step."""

AGENT_STATUS = ("episodes", "turns", "tool_calls", "tool_errors", "tool_timeouts", "sandbox_refusals", "truncated",
                "timed_out", "drifted", "turn_reward_mean")
"""The compact subset a TrainingJob's `status.agent` (and `rlkube local`) shows: the whole-job totals of the
episode counters (EPISODE, from `episode_<name>`) and the last reported `turn_reward_mean` (RATES)."""

EVALUATION_STATUS = ("reward_mean", "prompts", "skipped", "reward_errors")
"""The evaluation numbers `status.trainer` shows (as evalRewardMean, evalPrompts, evalSkipped, evalRewardErrors)."""


def episode_counter(name: str) -> Counter:
    try:
        return EPISODE[name]
    except KeyError:
        raise ValueError(f"{name!r} is no episode counter (rlkube.contract.counters.EPISODE: "
                         f"{', '.join(EPISODE)})") from None


def group_totals(episodes: Sequence[Mapping[str, Number]]) -> dict[str, Number]:
    """A group's episode counts (one mapping per episode, as `Sample.episode` carries them) summed, with
    `episodes`, each as its counter's type: a group without per-turn rewards adds 0.0 to turn_reward_sum."""
    totals: dict[str, Number] = {"episodes": len(episodes)}
    for episode in episodes:
        for name, value in episode.items():
            kind = episode_counter(name).type
            totals[name] = kind(totals.get(name, 0)) + kind(value)
    return totals


def script_args(totals: Mapping[str, Number]) -> list[str]:
    """A group's episode counts as the write script's (field, "i" or "f", value) triples: HINCRBY for an integer
    counter, HINCRBYFLOAT for a float one, whatever Python type each value has."""
    out: list[str] = []
    for name, value in totals.items():
        counter = episode_counter(name)
        parsed = counter.parse(value)
        if parsed is None:
            raise ValueError(f"episode counter {name}: {value!r} is no {counter.type.__name__}")
        out += [name, "i", str(parsed)] if counter.type is int else [name, "f", repr(parsed)]
    return out


def read_hash(raw: Mapping[Any, Any]) -> dict[str, Number]:
    """The episode counts hash (HGETALL) as {name: int or float} by each counter's type; fields that are no
    counter, or unreadable, are left out."""
    out: dict[str, Number] = {}
    for key, value in raw.items():
        name = key.decode() if isinstance(key, bytes) else str(key)
        counter = EPISODE.get(name)
        parsed = counter.parse(value) if counter is not None else None
        if parsed is not None:
            out[name] = parsed
    return out


def _rounded(value: Number) -> Number:
    # a status field, not a metric's full precision (as the other status numbers, rlkube.lifecycle.progress)
    return round(value, 4) if isinstance(value, float) else value


def agent_status(metrics: Mapping[str, Any]) -> dict[str, Number] | None:
    """The AGENT_STATUS numbers of one trainer metrics payload, typed by their counters; None when it has none
    (a single-turn job)."""
    out: dict[str, Number] = {}
    for name in AGENT_STATUS:
        counter = EPISODE.get(name) or RATES[name]
        key = METRIC_PREFIX + name if name in EPISODE else name
        value = counter.parse(metrics.get(key))
        if value is not None:
            out[name] = _rounded(value)
    return out or None


def evaluation_status(payload: Mapping[str, Any]) -> dict[str, Number]:
    """The EVALUATION_STATUS numbers of one evaluation payload, typed by their counters (those it carries)."""
    out: dict[str, Number] = {}
    for name in EVALUATION_STATUS:
        value = EVALUATION[name].parse(payload.get(name))
        if value is not None:
            out[name] = _rounded(value)
    return out
