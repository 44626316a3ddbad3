"""The API server's own request counters around each measured run of `rlkube bench operator`.

They say where a controller's time goes on the server side, which the client-side latencies cannot: how many
requests of which kind (verb and resource) it made per job, and how long the API server took to serve them
(apiserver_request_total and apiserver_request_duration_seconds, read from the API server's /metrics before
and after a run; the difference is that run's). Other clients of the same API server in the same window (the
bench's kubelet and watches, the garbage collector) are counted too: the figures compare two runs made the
same way, they do not isolate one process. Watches are left out (their duration is the watch's lifetime).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from rlkube.bench import processes

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION"})
LONG_RUNNING = frozenset({"WATCH", "WATCHLIST", "CONNECT"})
SLOWEST = 6


@dataclass
class Requests:
    """Request counts and the API server's summed serving time, per "VERB resource[/subresource]"."""

    count: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)
    cpu: Counter = field(default_factory=Counter)
    """CPU seconds of local processes by name (the API server, etcd, the controller under test)."""

    def __sub__(self, earlier: Requests) -> Requests:
        return Requests(self.count - earlier.count, self.seconds - earlier.seconds, self.cpu - earlier.cpu)


def _kind(labels: dict[str, str]) -> str | None:
    verb = labels.get("verb", "")
    if not verb or verb in LONG_RUNNING:
        return None
    resource = labels.get("resource", "")
    if labels.get("subresource"):
        resource += "/" + labels["subresource"]
    return f"{verb} {resource}"


def parse(text: str) -> Requests:
    """The request counters of one /metrics page (Prometheus text format)."""
    out = Requests()
    for family in text_string_to_metric_families(text):
        if family.name not in ("apiserver_request", "apiserver_request_duration_seconds"):
            continue
        for sample in family.samples:
            kind = _kind(sample.labels)
            if kind is None:
                continue
            if sample.name == "apiserver_request_total":
                out.count[kind] += sample.value
            elif sample.name == "apiserver_request_duration_seconds_sum":
                out.seconds[kind] += sample.value
    return out


async def scrape(api: client.ApiClient, pids: dict[str, int] | None = None) -> Requests:
    """The API server's counters now (GET /metrics with the client's credentials), and the CPU seconds so far
    of the local control plane's processes and of `pids` (name -> pid)."""
    response = await api.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False)
    out = parse(await response.text())
    out.cpu.update(processes.cpu_by_name())
    for name, pid in (pids or {}).items():
        out.cpu[name] += processes.usage(pid)[1]
    return out


def summary(delta: Requests, jobs: int) -> dict:
    """What a run cost the API server, per job: requests, writes by kind, and the mean time it took to serve one."""
    total = sum(delta.count.values())
    writes = {kind: n for kind, n in delta.count.items() if kind.split(" ", 1)[0] in MUTATING and n > 0}
    return {
        "requests_per_job": round(total / jobs, 1),
        "writes_per_job": round(sum(writes.values()) / jobs, 1),
        "writes_by_kind_per_job": {kind: round(n / jobs, 2) for kind, n in sorted(writes.items(), key=lambda kv: -kv[1])},
        "mean_request_ms": round(1000 * sum(delta.seconds.values()) / total, 1) if total else None,
        # Where the serving time went: the kinds that took most of it, with their mean.
        "mean_ms_of_slowest_kinds": {
            kind: round(1000 * seconds / delta.count[kind], 1)
            for kind, seconds in delta.seconds.most_common(SLOWEST) if delta.count[kind] > 0
        },
        # Where the machine's CPU went ("kube-controller" is every kube-controller-manager: the Job controller's
        # and the control plane's own garbage collector).
        "cpu_ms_per_job": {name: round(1000 * s / jobs, 1) for name, s in sorted(delta.cpu.items()) if s > 0},
    }
