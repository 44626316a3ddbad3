"""What `rlkube bench operator` prints: percentiles, ratios to the Job controller baseline, the table, and the
Job controller's invocation and Jobs (rlkube.bench.report, rlkube.bench.jobcontroller)."""

from __future__ import annotations

import math
import os
import stat

import pytest

from rlkube.bench import jobcontroller, report


def test_percentile_inclusive_interpolates_between_ranks():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert report.percentile(values, 50) == pytest.approx(50.5)
    assert report.percentile(values, 99) == pytest.approx(99.01)
    assert report.percentile([3.0, 1.0, 2.0], 99) == pytest.approx(2.98)  # order does not matter
    assert report.percentile([7.0], 99) == 7.0
    assert math.isnan(report.percentile([], 50))


def test_ratio_is_ours_over_theirs_and_none_without_a_baseline():
    assert report.ratio(6.0, 4.0) == 1.5
    assert report.ratio(1.0, 3.0) == 0.33
    assert report.ratio(1.0, None) is None
    assert report.ratio(None, 1.0) is None
    assert report.ratio(1.0, 0.0) is None
    assert report.ratio(float("nan"), 1.0) is None


def test_summary_compares_create_and_teardown_with_the_job_controllers_create():
    create = [1.0, 2.0, 3.0, 4.0]
    teardown = [2.0, 2.0, 2.0, 10.0]
    baseline = [0.5, 1.0, 1.0, 2.0]
    row = report.summary(4, create, teardown, 123.456, baseline, load_1m=1.234)
    assert row["n"] == 4 and row["operator_rss_mb"] == 123.5 and row["load_1m"] == 1.23
    assert row["create_to_children_p50"] == 2.5
    assert row["create_to_children_p99"] == pytest.approx(3.97)
    assert row["job_controller_create_p50"] == 1.0
    assert row["job_controller_create_p99"] == pytest.approx(1.97)
    assert row["create_ratio_p50"] == 2.5
    assert row["create_ratio_p99"] == round(3.97 / 1.97, 2)
    # Our teardown p99 over the Job controller's CREATE p99 (it has no ordered teardown to compare with).
    assert row["finished_to_released_p99"] == pytest.approx(9.76)
    assert row["teardown_ratio_p99"] == round(9.76 / 1.97, 2)


def test_summary_without_a_baseline_has_the_same_keys_with_no_values():
    with_baseline = report.summary(2, [1.0, 2.0], [1.0, 2.0], 80.0, [1.0, 1.0])
    without = report.summary(2, [1.0, 2.0], [1.0, 2.0], 80.0, None)
    assert list(without) == list(with_baseline)
    assert without["job_controller_create_p99"] is None and without["create_ratio_p99"] is None
    assert without["teardown_ratio_p99"] is None and without["create_to_children_p99"] == pytest.approx(1.99)


def test_table_aligns_columns_and_names_them():
    rows = [report.summary(2, [1.0], [2.0], 81.5, [0.5]), report.summary(200, [10.0], [20.0], 312.25, None)]
    lines = report.table(rows).splitlines()
    body = lines[-3:]
    assert len({len(line) for line in body}) == 1  # right-aligned to common widths
    assert "Job ctl p99" in body[0] and "teardown x p99" in body[0]
    assert body[1].split()[:6] == ["2", "1.0", "1.0", "2.0", "2.0", "81.5"]
    assert body[1].split()[6:10] == ["0.5", "0.5", "2.0", "2.0"]  # Job ctl p50/p99, create x p50/p99
    assert body[2].split()[6:] == ["-"] * 6  # no baseline: no Job ctl figures, ratios or load


def test_job_controller_jobs_have_one_pod_per_child_and_never_retry():
    job = jobcontroller.job_manifest("job-0001", 4)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 4
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert labels[jobcontroller.LABEL] == jobcontroller.VALUE  # what the pod clock watches


def test_controller_manager_runs_only_the_job_controller_at_100_qps(tmp_path):
    argv = jobcontroller.controller_manager_argv("/bin/kcm", tmp_path / "kubeconfig")
    assert argv[0] == "/bin/kcm"
    assert f"--kubeconfig={tmp_path / 'kubeconfig'}" in argv
    assert "--controllers=job" in argv and "--leader-elect=false" in argv
    assert "--kube-api-qps=100" in argv and "--kube-api-burst=100" in argv


def test_find_controller_manager_prefers_the_explicit_path_then_the_environment(tmp_path, monkeypatch):
    def executable(name: str) -> str:
        path = tmp_path / name
        path.write_text("#!/bin/sh\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return str(path)

    explicit, from_env = executable("explicit"), executable("env")
    monkeypatch.setenv("KUBE_CONTROLLER_MANAGER_BIN", from_env)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("RLKUBE_CACHE", str(tmp_path / "no-cache"))
    assert jobcontroller.find_controller_manager(explicit) == explicit
    assert jobcontroller.find_controller_manager(None) == from_env
    assert jobcontroller.find_controller_manager(str(tmp_path / "missing")) == from_env
    monkeypatch.delenv("KUBE_CONTROLLER_MANAGER_BIN")
    assert jobcontroller.find_controller_manager(None) is None
    cached = tmp_path / "no-cache" / "k8s-1.20.2" / "bin"
    cached.mkdir(parents=True)
    os.rename(executable("kube-controller-manager"), cached / "kube-controller-manager")
    assert jobcontroller.find_controller_manager(None) == str(cached / "kube-controller-manager")


def test_table_prints_nested_figures_after_the_rows():
    row = report.summary(2, [1.0], [2.0], 81.5, [0.5])
    row["api_requests"] = {"ours": {"writes_per_job": 12.5}, "job_controller": None}
    lines = report.table([row]).splitlines()
    assert lines[-1] == 'N=2 api_requests: {"ours": {"writes_per_job": 12.5}, "job_controller": null}'
    assert "api_requests" not in lines[-3] and lines[-3].endswith("load")  # not a column of the table
    assert len(lines[-2]) == len(lines[-3])
