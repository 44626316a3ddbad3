"""The operator's Prometheus metrics (prometheus-client), served on `rlkube operator --metrics-port`.

Module-level collectors in the default registry: the operator is one process, and the tests read the
same endpoint a Prometheus would scrape. The per-job gauges (phase, step, lag, reward, restarts, teardown stages...)
are `JOBS`, read from the status each pass writes (jobmetrics.py).
"""

from __future__ import annotations

from collections import Counter as _Tally

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from rlkube.api.status import Phase
from rlkube.controller.reconcile.jobmetrics import JobStatusCollector

JOBS_BY_PHASE = Gauge("rlkube_trainingjobs", "TrainingJobs handled by this operator, by phase", ["phase"])
RECONCILE_SECONDS = Histogram(
    "rlkube_reconcile_duration_seconds",
    "Duration of one reconcile pass (observe, decide, apply, status patch)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
RECONCILE_PASSES = Counter(
    "rlkube_reconcile_passes_total", "Reconcile passes per TrainingJob", ["namespace", "trainingjob"]
)
TRAINER_EVENT_LAG = Histogram(
    "rlkube_trainer_event_lag_seconds",
    "Time from a trainer event's XADD (its stream id) to the operator reading it",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
TEARDOWN_SECONDS = Histogram(
    "rlkube_teardown_duration_seconds",
    "Ordered teardown duration, first stage start to ResourcesReleased",
    ["reason"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
FORCE_DELETIONS = Counter(
    "rlkube_force_deletions_total", "Pods force-deleted after their teardown stage's grace period", ["role"]
)
LEADER = Gauge(
    "rlkube_operator_leader",
    "1 while this operator process acts (holds the leader election Lease, or runs without election), else 0",
)
JOBS = JobStatusCollector()
REGISTRY.register(JOBS)
API_ERRORS = Counter("rlkube_api_errors_total", "Failed Kubernetes API calls of reconcile passes", ["verb", "kind"])


def set_phases(phases: dict[object, str]) -> None:
    """Replace the jobs-by-phase gauge with the current phase of every known job."""
    tally = _Tally(phases.values())
    for phase in Phase:
        JOBS_BY_PHASE.labels(phase).set(tally.get(phase, 0))


def forget_job(namespace: str, name: str) -> None:
    """Drop a deleted job's series (their number follows the jobs that exist)."""
    JOBS.forget(namespace, name)
    try:
        RECONCILE_PASSES.remove(namespace, name)
    except KeyError:
        pass


def serve(port: int) -> None:
    if port:
        start_http_server(port)
