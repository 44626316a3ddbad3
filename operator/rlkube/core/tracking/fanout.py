"""`Trackers`: what the trainer logs to, one call fanned out to every configured sink (docs/design.md §11).

Every method returns at once: each sink has its own background worker (rlkube.core.tracking.worker). Without any
sink configured (or on a trainer rank other than 0) the methods do nothing, so callers need not check. A sink's
first failure is kept as a `TrackerFailure` (its message stripped of the secrets the trainer holds) for the
trainer to report once (`take_failures`), and that sink gets nothing more in this process.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.api.spec import TrainingJobSpec
from rlkube.api.tracking import TrackingSpec
from rlkube.contract import runtime
from rlkube.core.tracking.run import RunState
from rlkube.core.tracking.worker import Sink, SinkWorker

log = logging.getLogger("rlkube.tracking")

TRACKING_DIR = "tracking"
"""Below the trainer's checkpoint directory: the run state, TensorBoard's event files, W&B's offline runs."""
SECRET_ENV = (runtime.ENV_WANDB_API_KEY, "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
"""Values the trainer holds that no failure report may repeat."""
MAX_MESSAGE = 1000
CLOSE_TIMEOUT_S = 15.0
"""How long `close` waits for each sink to flush (their workers run in parallel)."""


@dataclass(frozen=True)
class TrackerFailure:
    tracker: str
    message: str


class Trackers:
    def __init__(self, workers: list[SinkWorker] | None = None, run: RunState | None = None,
                 secrets: tuple[str, ...] = ()):
        self.workers = workers or []
        self.run = run
        self.secrets = tuple(s for s in secrets if s)
        self._failures: list[TrackerFailure] = []
        self._lock = threading.Lock()

    @classmethod
    def none(cls) -> Trackers:
        return cls()

    @property
    def names(self) -> list[str]:
        return [w.name for w in self.workers]

    def add(self, sink: Sink) -> None:
        self.workers.append(SinkWorker(sink, self._failed, self.run))

    def log_params(self, params: dict[str, Any]) -> None:
        self._submit("log_params", dict(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Finite numbers only (None, NaN and non-numbers are left out); a series' step is logged once per run and
        tracker (rlkube.core.tracking.run)."""
        clean = {k: float(v) for k, v in metrics.items()
                 if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if clean:
            self._submit("log_metrics", clean, int(step))

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Rows of one table at `step` (MLflow: a JSON table artifact `name`.json; W&B: a wandb.Table; TensorBoard
        has none)."""
        if rows:
            self._submit("log_table", name, [dict(r) for r in rows], int(step))

    def close(self, finished: bool = True, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flush and close every sink (in parallel, each bounded by `timeout_s`). `finished`: the training reached
        its end (else the runs are marked stopped, to be resumed)."""
        closers = [threading.Thread(target=w.close, args=(finished, timeout_s), daemon=True) for w in self.workers]
        for t in closers:
            t.start()
        deadline = time.monotonic() + timeout_s + 1
        for t in closers:
            t.join(max(0.0, deadline - time.monotonic()))

    def take_failures(self) -> list[TrackerFailure]:
        """The failures not yet taken (each sink fails at most once per process)."""
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def _submit(self, method: str, *args: Any) -> None:
        for worker in self.workers:
            worker.submit(method, *args)

    def _failed(self, tracker: str, exc: BaseException) -> None:
        message = redact(f"{type(exc).__name__}: {exc}", self.secrets)[:MAX_MESSAGE]
        log.warning("tracking: %s failed, nothing more is sent to it (training goes on): %s", tracker, message)
        with self._lock:
            self._failures.append(TrackerFailure(tracker, message))


_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")


def redact(text: str, secrets: tuple[str, ...]) -> str:
    """`text` without any of `secrets` and without the user:password part of URLs."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
    return _USERINFO.sub(r"\1[redacted]@", text)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (`algorithm.learningRate`); lists stay values."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, inner in value.items():
        out.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return out


def job_params(namespace: str, name: str, spec: TrainingJobSpec) -> dict[str, Any]:
    """The job's config as tracker params: the spec as written on the wire (camelCase, set fields and defaults),
    flattened, plus the job's namespace and name. Secrets are never in a spec (only references to them)."""
    wire = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {"job.namespace": namespace, "job.name": name, **flatten(wire, "spec")}


def build_trackers(spec: TrackingSpec, namespace: str, name: str, directory: Path | None, env=None,
                   uid: str | None = None) -> Trackers:
    """The sinks `spec` configures, their run state kept in `directory` (the checkpoint directory's `tracking/`;
    None: nowhere, a run that cannot be resumed) for the run `uid`. Nothing configured: a Trackers that does
    nothing."""
    env = os.environ if env is None else env
    if not spec.any:
        return Trackers.none()
    run = RunState(directory, name, uid)
    tags = {"rlkube.namespace": namespace, "rlkube.job": name}
    trackers = Trackers(run=run, secrets=tuple(env.get(k, "") for k in SECRET_ENV))
    base = Path(directory) if directory is not None else Path(TRACKING_DIR)
    if spec.mlflow is not None:
        from rlkube.core.tracking.mlflow_sink import MlflowSink

        trackers.add(MlflowSink(spec.mlflow, run, tags))
    if spec.wandb is not None:
        from rlkube.core.tracking.wandb_sink import WandbSink

        trackers.add(WandbSink(spec.wandb, run, base / "wandb", tags))
    if spec.tensorboard is not None:
        from rlkube.core.tracking.tensorboard_sink import TensorBoardSink

        trackers.add(TensorBoardSink(base / spec.tensorboard.directory))
    log.info("tracking: %s, run %r%s", ", ".join(trackers.names), run.name, " (resumed)" if run.resumed else "")
    return trackers
