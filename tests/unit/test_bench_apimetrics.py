"""The API server's request counters as `rlkube bench operator` reads them (rlkube.bench.apimetrics)."""

from collections import Counter

import pytest

from rlkube.bench import apimetrics

# The shape kube-apiserver 1.20 serves at /metrics (label sets abridged to the ones apimetrics reads and a few
# it must ignore).
PAGE = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out for each verb, ...
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} %(post_ok)s
apiserver_request_total{code="409",component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",group="rlkube.io",resource="trainingjobs",scope="namespace",subresource="status",verb="PATCH",version="v1alpha1"} %(status)s
apiserver_request_total{code="200",component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 7
apiserver_request_total{code="200",component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 3
# HELP apiserver_request_duration_seconds [STABLE] Response latency distribution in seconds ...
# TYPE apiserver_request_duration_seconds histogram
apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1",le="0.05"} 10
apiserver_request_duration_seconds_bucket{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1",le="+Inf"} 12
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} %(post_s)s
apiserver_request_duration_seconds_count{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="POST",version="v1"} 12
apiserver_request_duration_seconds_sum{component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 900
# HELP etcd_request_duration_seconds unrelated
# TYPE etcd_request_duration_seconds histogram
etcd_request_duration_seconds_sum{operation="create",type="*core.Pod"} 5
"""


def page(post_ok: int, status: int, post_s: float) -> str:
    return PAGE % {"post_ok": post_ok, "status": status, "post_s": post_s}


def test_counts_requests_by_verb_and_resource_without_watches():
    got = apimetrics.parse(page(10, 4, 0.6))
    assert got.count == {"POST pods": 12, "PATCH trainingjobs/status": 4, "LIST pods": 3}
    assert got.seconds == {"POST pods": pytest.approx(0.6)}


def test_a_run_is_the_difference_of_two_pages_per_job():
    before = apimetrics.parse(page(10, 4, 0.6))
    after = apimetrics.parse(page(18, 8, 1.0))
    got = apimetrics.summary(after - before, jobs=2)
    # 8 pod POSTs and 4 status PATCHes in the window, 0.4 s of serving time over those 12 requests
    assert got == {
        "requests_per_job": 6.0,
        "writes_per_job": 6.0,
        "writes_by_kind_per_job": {"POST pods": 4.0, "PATCH trainingjobs/status": 2.0},
        "mean_request_ms": pytest.approx(33.3),
        "mean_ms_of_slowest_kinds": {"POST pods": pytest.approx(50.0)},  # 0.4 s over 8 POSTs
        "cpu_ms_per_job": {},
    }


def test_no_requests_has_no_mean():
    same = apimetrics.parse(page(10, 4, 0.6))
    assert apimetrics.summary(same - same, jobs=3)["mean_request_ms"] is None


def test_cpu_is_the_difference_per_job_by_process():
    before = apimetrics.Requests(cpu=Counter({"kube-apiserver": 10.0, "operator": 1.0, "etcd": 2.0}))
    after = apimetrics.Requests(cpu=Counter({"kube-apiserver": 14.0, "operator": 3.0, "etcd": 2.0}))
    assert apimetrics.summary(after - before, jobs=4)["cpu_ms_per_job"] == {"kube-apiserver": 1000.0, "operator": 500.0}
