"""Where the suite's wall time goes: per test phase, the wall time and the CPU time spent by pytest's process tree.

A test whose CPU/wall ratio is low waits on the clock (a polling interval, a backoff, a grace period) rather than
computing, and is the first place to look when the suite is slow. Opt-in: `RLKUBE_TEST_CPU=path.jsonl pytest ...`
appends one JSON line per phase (setup, call, teardown; with the fixtures that took 0.2 s or more to set up or tear
down, a session-scoped server's start and stop included) and one per session mark (start, collected, finish), and
prints the slowest tests with their ratio at the end. With pytest-xdist each worker appends to the same file.

CPU time is the pytest process's own (RUSAGE_SELF), its reaped children's (RUSAGE_CHILDREN) and, since fixtures keep
servers running across tests and a child is only counted once reaped, the growth of every live descendant's
user+system time (children included) sampled from /proc at the start and end of each phase. A descendant that was
alive at the start and is gone at the end has its earlier time subtracted again: it reaches the totals through
whoever reaped it. A descendant orphaned to init is lost; on a 2-core machine `cpu / wall` is at most 2.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

import psutil
import pytest

ENV = "RLKUBE_TEST_CPU"


def _tree_cpu() -> dict[tuple[int, float], float]:
    """CPU seconds (own and reaped children) of each live descendant, keyed by (pid, start time)."""
    out = {}
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return out
    for proc in children:
        try:
            with proc.oneshot():
                t = proc.cpu_times()
                out[(proc.pid, proc.create_time())] = t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return out


def _own() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


class CpuTiming:
    def __init__(self, path: Path):
        self.path = path
        self.totals: dict[str, dict[str, float]] = {}
        self.fixtures: dict[str, float] = {}  # the current phase's slow fixtures: seconds of setup or teardown
        self.last = 0.0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef):
        t0 = time.monotonic()
        yield
        self._fixture(fixturedef, time.monotonic() - t0)

    def pytest_fixture_post_finalizer(self, fixturedef):
        # No hook runs before a finalizer: a fixture's teardown is the time since the previous one ended.
        now = time.monotonic()
        self._fixture(fixturedef, now - self.last)
        self.last = now

    def _fixture(self, fixturedef, seconds: float) -> None:
        if seconds >= 0.2:
            key = f"{fixturedef.argname}[{fixturedef.scope}]"
            self.fixtures[key] = round(self.fixtures.get(key, 0.0) + seconds, 2)

    def _measure(self, item, phase: str):
        wall0, (self0, kids0), tree0 = time.monotonic(), _own(), _tree_cpu()
        self.fixtures, self.last = {}, wall0
        yield
        wall1, (self1, kids1), tree1 = time.monotonic(), _own(), _tree_cpu()
        tree = sum(cpu - tree0.get(key, 0.0) for key, cpu in tree1.items())
        tree -= sum(cpu for key, cpu in tree0.items() if key not in tree1)
        row = {
            "test": item.nodeid, "phase": phase, "end": round(time.time(), 3), "wall": round(wall1 - wall0, 3),
            "cpu_self": round(self1 - self0, 3), "cpu_children": round(kids1 - kids0 + tree, 3),
        }
        row["cpu"] = round(row["cpu_self"] + row["cpu_children"], 3)
        if self.fixtures:
            row["fixtures"] = self.fixtures
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        total = self.totals.setdefault(item.nodeid, {"wall": 0.0, "cpu": 0.0})
        total["wall"] += row["wall"]
        total["cpu"] += row["cpu"]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self._measure(item, "setup")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        yield from self._measure(item, "call")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self._measure(item, "teardown")

    def _mark(self, event: str) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    def pytest_sessionstart(self):
        self._mark("sessionstart")

    def pytest_collection_finish(self):
        self._mark("collected")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self):
        self._mark("sessionfinish")

    def pytest_terminal_summary(self, terminalreporter):
        rows = sorted(self.totals.items(), key=lambda kv: -kv[1]["wall"])[:30]
        terminalreporter.section(f"wall and CPU per test ({self.path})")
        for nodeid, t in rows:
            ratio = t["cpu"] / t["wall"] if t["wall"] else 0.0
            terminalreporter.write_line(f"{t['wall']:8.2f}s wall {t['cpu']:8.2f}s cpu {ratio:5.2f}  {nodeid}")


def register(config) -> None:
    path = os.environ.get(ENV)
    if path:
        config.pluginmanager.register(CpuTiming(Path(path).resolve()), "rlkube-cpu-timing")
