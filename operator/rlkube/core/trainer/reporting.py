"""What the trainer reports each step: its metrics event (docs/design.md §5.2) and the experiment trackers.

A mixin of rlkube.core.trainer.role.TrainerRole, kept apart so the loop there reads as its four named steps
(collect, train, publish, checkpoint): here the step's document statistics (a collective with data parallelism),
the metrics rank 0 publishes, the episode counters and filtered groups it reads from Redis, and the trackers
(train/ and eval/ series, the bounded wait for the final evaluation, tracker failures as events).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis

from rlkube.contract import counters, protocol
from rlkube.contract.step_metrics import StepMetrics

log = logging.getLogger("rlkube.trainer")

EVALUATION_WAIT_S = 60.0  # how long the finished trainer waits for the final version's evaluation (trackers, samples)
EVALUATION_POLL_S = 1.0  # how often it looks for that evaluation

OFF_POLICY = ("logprob_diff_abs", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_truncated_fraction",
              "is_masked_fraction", "ref_kl")
"""The loss's optional step metrics (rlkube.core.training.losses: trainer vs sampler log-probs, the reference KL),
reported when it measured them."""

EPISODE_COUNTS = tuple(name for name, c in counters.EPISODE.items() if c.type is int)
"""The episode counters the metrics report as whole-job totals (`episode_<name>`); the float sum of the per-turn
rewards is reported as their mean (`turn_reward_mean`)."""


class StepReports:
    """The reporting half of TrainerRole (its attributes: ctx, redis, keys, trainer, parallel, leader, stop,
    trackers, samples, skipped and the bookkeeping set in TrainerRole.__init__)."""

    def _track_step(self, metrics: StepMetrics) -> None:
        """The step's metrics to the trackers (as `train/<name>`), the evaluation results actor 0 reported since
        (as `eval/<name>` at their weight version), and any tracker failure as a `tracker_failed` event."""
        if not self.trackers.workers:
            return
        self.trackers.log_metrics({f"train/{k}": v for k, v in metrics.payload().items() if k != "step"},
                                  metrics.step)
        self._track_evaluations()
        self._report_tracker_failures()

    def _track_evaluations(self) -> None:
        """Evaluation events (docs/design.md §5.2) read from the events stream since the last look."""
        try:
            got = self.redis.xread({self.keys.events: self._tracked_events}, count=10_000)
        except redis.RedisError as exc:
            log.warning("tracking: could not read the evaluation results: %s", exc)
            return
        for _, entries in got or []:
            for sid, fields in entries:
                self._tracked_events = protocol.text(sid)
                event = protocol.decode_event(sid, fields)
                if event is None or event.type != protocol.EVALUATION:
                    continue
                version = protocol.as_int64(event.payload.get("version"))
                if version is None:
                    continue
                self._eval_versions.add(version)
                self.trackers.log_metrics({f"eval/{k}": v for k, v in event.payload.items()
                                           if k not in ("type", "version", "actor")}, version)

    def _await_final_evaluation(self) -> None:
        """With spec.evaluation and trackers or samples, wait (bounded: EVALUATION_WAIT_S, at most half of
        completionTimeoutSeconds; never on a stop) for the evaluation of the final version, which actor 0 scores
        after the final weights_ready: its results should reach the trackers and its rows samples.jsonl too (actor 0
        sends the rows just after the result). Training is over; nothing waits here."""
        ev = self.ctx.spec.evaluation
        tracking = bool(self.trackers.workers)
        sampling = self.samples is not None and self.samples.enabled and self.samples.leader
        if ev is None or not (tracking or sampling) or self._stopping():
            return
        due = self.trainer.version - self.trainer.version % ev.every_versions

        def arrived() -> bool:
            if tracking:
                self._track_evaluations()
            if sampling:
                self._drain_evaluation_samples()
            return ((not tracking or any(v >= due for v in self._eval_versions))
                    and (not sampling or any(v >= due for v in self.samples.eval_done or ())))

        limit = min(EVALUATION_WAIT_S, self.ctx.spec.run_policy.completion_timeout_seconds / 2)
        log.info("waiting up to %.0fs for the evaluation of version %d", limit, due)
        deadline = time.monotonic() + limit
        while not arrived():
            if time.monotonic() >= deadline:
                log.info("no evaluation of version %d within %.0fs: finishing without it", due, limit)
                return
            if self.stop.wait(EVALUATION_POLL_S):
                return

    def _close_trackers(self, finished: bool) -> None:
        """Wait for the final evaluation (bounded), then flush and close the trackers (bounded) and report what
        failed, before training_finished."""
        if finished:
            self._await_final_evaluation()
        if not self.trackers.workers:
            return
        self._track_evaluations()
        self._drain_evaluation_samples()  # the final evaluation's rows too, while the trackers take tables
        self.trackers.close(finished=finished)
        self._report_tracker_failures()

    def _report_tracker_failures(self) -> None:
        for failure in self.trackers.take_failures():
            self._event(protocol.TRACKER_FAILED, tracker=failure.tracker, message=failure.message)

    def _document_stats(self, docs: Sequence[protocol.Document], version: int) -> dict[str, float]:
        """The step's document statistics; with data parallelism, over every rank's share (two tiny collectives,
        on every rank: the metrics rank 0 publishes describe the whole step)."""
        versions = [int(d.model_version[d.loss_mask()].min()) for d in docs
                    if d.model_version is not None and d.loss_mask().any()]
        lags = [version - v for v in versions]
        sums = [sum(d.reward for d in docs), len(docs), sum(len(d.tokens) for d in docs),
                sum(1 for lag in lags if lag > self.ctx.spec.algorithm.max_lag), sum(d.reward_error for d in docs)]
        lag_max = max(lags) if lags else 0
        sums = self.parallel.sum(sums)
        lag_max = self.parallel.max(lag_max)
        reward_sum, n, tokens, stale, reward_errors = sums
        return {"reward_mean": reward_sum / max(n, 1), "lag_max": int(lag_max), "stale_documents": int(stale),
                "tokens": int(tokens), "reward_errors": int(reward_errors)}

    def _metrics(self, d: dict[str, float], m: dict[str, float], wait_s: float, busy_s: float,
                 publish_s: float) -> StepMetrics:
        tokens = d["tokens"]
        wall = max(wait_s + busy_s + publish_s, 1e-9)
        return StepMetrics(
            step=self.trainer.step,
            version=self.trainer.version,
            loss=m["loss"],
            reward_mean=d["reward_mean"],
            reward_errors=d["reward_errors"],
            lag_max=d["lag_max"],
            stale_documents=d["stale_documents"],
            tokens=tokens,
            loss_tokens=int(m["loss_tokens"]),
            tokens_per_s=tokens / wall,
            busy_s=busy_s,
            wait_s=wait_s,
            publish_s=publish_s,
            ratio_mean=m["ratio_mean"],
            clipped_fraction=m["clipped_fraction"],
            kl=m["kl"],
            entropy=m.get("entropy"),
            grad_norm=m["grad_norm"],
            learning_rate=m["lr"],
            documents_seen=self.trainer.documents_seen,
            documents_skipped=self.skipped,
            extra={**{k: m[k] for k in OFF_POLICY if k in m}, **self._filtered(), **self._episodes()},
        )

    def _filtered(self) -> dict[str, int]:
        """Zero-advantage groups (and their samples) the preprocessors dropped so far, whole job (rank 0 only:
        it alone publishes the metrics)."""
        if not self.leader:
            return {}
        groups, samples = self.redis.mget(self.keys.filtered_groups, self.keys.filtered_samples)
        return {"filtered_groups": int(groups or 0), "filtered_samples": int(samples or 0)}

    def _episodes(self) -> dict[str, float]:
        """The actors' multi-turn episode counts (rlkube.core.actor.episodes), whole job so far, and per episode since
        the previous step's report (rank 0 only); nothing for single-turn jobs."""
        if not self.leader or self.ctx.spec.task.environment is None:
            return {}
        totals = counters.read_hash(self.redis.hgetall(self.keys.episodes))  # each typed by its counter
        last = self._episodes_last
        self._episodes_last = totals
        out: dict[str, float] = {counters.METRIC_PREFIX + k: totals.get(k, 0) for k in EPISODE_COUNTS}
        new = totals.get("episodes", 0) - last.get("episodes", 0)
        if new > 0:
            for key in ("turns", "tool_calls"):
                out[f"{key}_per_episode"] = (totals.get(key, 0) - last.get(key, 0)) / new
        rewarded = totals.get("turn_rewards", 0) - last.get("turn_rewards", 0)
        if rewarded > 0:  # the mean reward per rewarded turn since the previous report
            out["turn_reward_mean"] = (totals.get("turn_reward_sum", 0) - last.get("turn_reward_sum", 0)) / rewarded
        return out
