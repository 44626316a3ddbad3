"""The jobs the benchmarks build in code (they run from an installed package, with no examples/ beside them)."""

from __future__ import annotations

from rlkube.lifecycle.validation import parse_manifest
from rlkube.bench import operator as bench_operator
from rlkube.bench import pipeline
from support import specs


def test_bench_pipeline_runs_the_tiny_example_job():
    # `rlkube bench pipeline` is documented as the tiny example pipelined vs synchronous.
    _, bench = parse_manifest(pipeline.TINY_JOB)
    _, example = parse_manifest(specs.document())
    assert bench == example


def test_bench_operator_jobs_are_valid_external_redis_jobs():
    meta, spec = parse_manifest(bench_operator.job_manifest("job-0001", "redis://127.0.0.1:6379/0"))
    assert meta["name"] == "job-0001"
    assert spec.redis.mode == "external" and spec.algorithm.max_steps == bench_operator.MAX_STEPS
