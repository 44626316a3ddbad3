"""What `rlkube bench operator` prints: percentiles, the comparison with Kubernetes' Job controller, the table.

Pure functions over lists of seconds, so the numbers the issue's targets are judged by have unit tests.
Ratios are ours / the Job controller's: 1.0 is as fast as the controller users already run, 3.0 three times
slower. The teardown ratio compares our finished -> released p99 with the Job controller's CREATE p99 (a
teardown should cost no more than a creation; the Job controller has no ordered teardown to compare with).
"""

from __future__ import annotations

import json
import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method: p100 is the largest value); NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs rounded to 2 places; None where either is missing or theirs is 0."""
    if ours is None or theirs is None or math.isnan(ours) or math.isnan(theirs) or theirs <= 0:
        return None
    return round(ours / theirs, 2)


def summary(
    n: int,
    create_to_children: list[float],
    finished_to_released: list[float],
    operator_rss_mb: float,
    job_controller_create: list[float] | None,
    load_1m: float | None = None,
) -> dict:
    """One result row (one N): our latencies, the Job controller's, the ratios, RSS (and the load it ran under)."""
    row = {
        "n": n,
        "create_to_children_p50": round(percentile(create_to_children, 50), 3),
        "create_to_children_p99": round(percentile(create_to_children, 99), 3),
        "finished_to_released_p50": round(percentile(finished_to_released, 50), 3),
        "finished_to_released_p99": round(percentile(finished_to_released, 99), 3),
        "operator_rss_mb": round(operator_rss_mb, 1),
    }
    baseline = {"p50": None, "p99": None}
    if job_controller_create:
        baseline = {q: round(percentile(job_controller_create, int(q[1:])), 3) for q in baseline}
    row["job_controller_create_p50"] = baseline["p50"]
    row["job_controller_create_p99"] = baseline["p99"]
    row["create_ratio_p50"] = ratio(row["create_to_children_p50"], baseline["p50"])
    row["create_ratio_p99"] = ratio(row["create_to_children_p99"], baseline["p99"])
    row["teardown_ratio_p99"] = ratio(row["finished_to_released_p99"], baseline["p99"])
    row["load_1m"] = None if load_1m is None else round(load_1m, 2)
    return row


HEADINGS = {
    "create_to_children_p50": "create p50",
    "create_to_children_p99": "create p99",
    "finished_to_released_p50": "teardown p50",
    "finished_to_released_p99": "teardown p99",
    "operator_rss_mb": "RSS MiB",
    "job_controller_create_p50": "Job ctl p50",
    "job_controller_create_p99": "Job ctl p99",
    "create_ratio_p50": "create x p50",
    "create_ratio_p99": "create x p99",
    "teardown_ratio_p99": "teardown x p99",
    "load_1m": "load",
}


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def table(results: list[dict]) -> str:
    """Right-aligned columns, one row per N (a key without a heading is printed under its own name); nested
    values (the API server's request figures) follow the table, a line each."""
    cols = [c for c in results[0] if not isinstance(results[0][c], dict)]
    nested = [(r["n"], c, r[c]) for r in results for c in r if isinstance(r[c], dict)]
    heads = [HEADINGS.get(c, c) for c in cols]
    rows = [[_cell(r.get(c)) for c in cols] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]
    lines = [" ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += [" ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    return (
        "rlkube operator vs Kubernetes' Job controller: N jobs at once on one API server (seconds; RSS in MiB)\n"
        "create = POST -> all children exist; teardown = training_finished -> ResourcesReleased; "
        "Job ctl = the Job controller's POST -> all pods exist; x = ours / Job ctl p50 or p99\n"
        + "\n".join(lines)
        + "".join(f"\nN={n} {key}: {json.dumps(value)}" for n, key, value in nested)
    )
