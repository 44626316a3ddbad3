"""Per-TrainingJob metrics, read from the status the reconcile loop writes (no second poller).

After each pass that wrote a job's status, the loop hands that status to `JOBS.observe`; a `JobSample` (a frozen
copy of the few numbers the metrics need) replaces the job's previous one. Prometheus' scrape thread reads the
samples through `JobStatusCollector.collect`, so every value is the one the API server holds in the job's status
(for the same pass), and `seconds since the last trainer event` is computed at scrape time from
`status.trainer.lastEventTime`. A job's series disappear with it (`forget`, on deletion): cardinality follows the
jobs that exist.

Every series has the labels `namespace` and `trainingjob` (as `rlkube_reconcile_passes_total`); a ServiceMonitor
scraping them should keep them (`honorLabels: true`, as the chart's does), or Prometheus renames `namespace`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rlkube.api.status import Phase, TrainingJobStatus
from rlkube.contract import counters
from rlkube.controller.decisions.times import parse_time

PHASES = tuple(Phase)
"""Every phase, in order: the phase gauge has a series for each (1 for the current one)."""
LABELS = ("namespace", "trainingjob")

PREFIX = "rlkube_trainingjob_"
"""Every per-job metric name starts with this (the dashboard test checks its queries against them)."""
AGENT_PREFIX = "agent_"
"""status.agent's counters are exposed as `rlkube_trainingjob_agent_<counter>` (rlkube.contract.counters)."""
EVAL_COUNTS = (("eval_prompts", "eval_prompts"), ("eval_skipped", "eval_skipped"),
               ("eval_reward_errors", "eval_reward_errors"))
"""(metric name after PREFIX, status.trainer field) of the last evaluation's counts."""


@dataclass(frozen=True)
class JobSample:
    phase: str
    step: int
    max_steps: int
    weights_version: int
    lag: int | None
    reward_mean: float | None
    tokens_per_second: float | None
    eval_reward_mean: float | None
    eval_version: int | None
    eval_counts: tuple[tuple[str, int], ...]
    """(name, value) of the last evaluation's counts in the status (EVAL_COUNTS)."""
    agent: tuple[tuple[str, int | float], ...]
    """(counter, value) of status.agent, those reported (rlkube.contract.counters.AGENT_STATUS)."""
    last_event_time: float | None
    """Epoch seconds of status.trainer.lastEventTime (when the operator read the trainer's last event)."""
    restarts: tuple[tuple[str, int], ...]
    teardown_stages: tuple[tuple[str, float], ...]
    """(stage, seconds from startedAt to finishedAt) of every finished teardown stage."""


def _epoch(value: str | None) -> float | None:
    parsed = parse_time(value)
    return parsed.timestamp() if parsed is not None else None


def sample(status: TrainingJobStatus) -> JobSample:
    """The numbers of one status that the metrics expose (pure)."""
    tr = status.trainer
    stages: dict[str, float] = {}  # by name: one series per stage even if a status ever repeated one
    for stage in status.teardown.stages if status.teardown else ():
        started, finished = _epoch(stage.started_at), _epoch(stage.finished_at)
        if started is not None and finished is not None:
            stages[stage.name] = finished - started
    return JobSample(
        phase=status.phase,
        step=tr.step,
        max_steps=tr.max_steps,
        weights_version=tr.weights_version,
        lag=status.lag,
        reward_mean=tr.reward_mean,
        tokens_per_second=tr.tokens_per_second,
        eval_reward_mean=tr.eval_reward_mean,
        eval_version=tr.eval_version,
        eval_counts=tuple((name, v) for name, field in EVAL_COUNTS if (v := getattr(tr, field)) is not None),
        agent=tuple((name, v) for name in counters.AGENT_STATUS
                    if status.agent is not None and (v := getattr(status.agent, name)) is not None),
        last_event_time=_epoch(tr.last_event_time),
        restarts=tuple(sorted((role, c.restarts) for role, c in status.components.items())),
        teardown_stages=tuple(stages.items()),
    )


class JobStatusCollector(Collector):
    """The latest sample of every job this operator handles, exposed as gauges at scrape time."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()  # the loop writes on the event loop thread, Prometheus reads on its own
        self._jobs: dict[tuple[str, str], JobSample] = {}

    def observe(self, namespace: str, name: str, status: TrainingJobStatus) -> None:
        new = sample(status)
        with self._lock:
            self._jobs[(namespace, name)] = new

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def jobs(self) -> dict[tuple[str, str], JobSample]:
        with self._lock:
            return dict(self._jobs)

    def describe(self) -> list:
        return []  # no fixed series: registration must not call collect() (it would read an empty snapshot)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = self.jobs()
        now = self._clock()

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, doc, labels=[*LABELS, *extra])

        phase = gauge("status_phase", "1 for the TrainingJob's current status.phase, 0 for the others", ("phase",))
        step = gauge("step", "Last optimizer step the trainer reported (status.trainer.step)")
        max_steps = gauge("max_steps", "spec.algorithm.maxSteps (status.trainer.maxSteps)")
        version = gauge("weights_version", "Last weight version the trainer published")
        lag = gauge("policy_lag", "Weight versions between the trainer and the stalest rollout of its last step")
        reward = gauge("reward_mean", "Mean reward of the last step's training documents (status.trainer.rewardMean)")
        tokens = gauge("tokens_per_second", "Tokens trained per second in the last step")
        eval_reward = gauge("eval_reward_mean", "Mean reward over the held-out eval set at the last evaluated weight "
                            "version (status.trainer.evalRewardMean; spec.evaluation)")
        eval_version = gauge("eval_version", "Weight version of the last evaluation (status.trainer.evalVersion)")
        eval_counts = {name: gauge(name, f"{counters.EVALUATION[name.removeprefix('eval_')].help} in the last "
                                         "evaluation (status.trainer)") for name, _ in EVAL_COUNTS}
        agent = {name: gauge(AGENT_PREFIX + name, f"Agent counter {name}: "
                             f"{(counters.EPISODE.get(name) or counters.RATES[name]).help} (status.agent; whole job "
                             "except turn_reward_mean, the last reported)") for name in counters.AGENT_STATUS}
        since = gauge("seconds_since_last_trainer_event",
                      "Seconds from status.trainer.lastEventTime (the operator read the trainer's last event) to now")
        restarts = gauge("component_restarts", "Restarts and replacements of a component's pods", ("component",))
        stages = gauge("teardown_stage_duration_seconds",
                       "Duration of a finished teardown stage (status.teardown.stages)", ("stage",))
        for (namespace, name), s in sorted(jobs.items()):
            key = [namespace, name]
            for p in PHASES:
                phase.add_metric([*key, p], 1.0 if s.phase == p else 0.0)
            step.add_metric(key, s.step)
            max_steps.add_metric(key, s.max_steps)
            version.add_metric(key, s.weights_version)
            # Absent, not 0, until the trainer reported it: a 0 would be a value nobody measured.
            if s.lag is not None:
                lag.add_metric(key, s.lag)
            if s.reward_mean is not None:
                reward.add_metric(key, s.reward_mean)
            if s.tokens_per_second is not None:
                tokens.add_metric(key, s.tokens_per_second)
            if s.eval_reward_mean is not None and s.eval_version is not None:
                eval_reward.add_metric(key, s.eval_reward_mean)
                eval_version.add_metric(key, s.eval_version)
            for name, value in s.eval_counts:
                eval_counts[name].add_metric(key, value)
            for name, value in s.agent:
                agent[name].add_metric(key, value)
            if s.last_event_time is not None:
                since.add_metric(key, max(0.0, now - s.last_event_time))
            for component, n in s.restarts:
                restarts.add_metric([*key, component], n)
            for stage, seconds in s.teardown_stages:
                stages.add_metric([*key, stage], seconds)
        yield from (phase, step, max_steps, version, lag, reward, tokens, eval_reward, eval_version,
                    *eval_counts.values(), *agent.values(), since, restarts, stages)
