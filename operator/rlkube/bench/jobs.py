"""A recorder of every TrainingJob status in one namespace, as the API server reports it (list + watch).

`rlkube bench operator` times jobs with it (when each first ran, when its ResourcesReleased turned True) and
the operator tests assert on it (the phases a job went through, in order; its latest status; when it was
deleted), so what both report is what the API server stored, not what the operator says it did.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kubernetes_asyncio import client

from rlkube.bench.listwatch import ListWatch


class JobRecorder:
    def __init__(self, api: client.ApiClient, namespace: str):
        self.namespace = namespace
        self.phases: dict[str, list[str]] = {}  # distinct phases in the order seen
        self.phase_at: dict[str, dict[str, float]] = {}  # job -> phase -> monotonic time first seen
        self.true_at: dict[str, dict[str, float]] = {}  # job -> condition type -> time first seen True
        self.latest: dict[str, dict] = {}
        self.gone: dict[str, float] = {}
        self.seq: dict[str, int] = {}  # job -> number of the last event about it (all jobs counted together)
        self._n = 0
        self._changed = asyncio.Condition()
        self._watch = ListWatch.trainingjobs(api, namespace, self._record)

    async def start(self) -> JobRecorder:
        await self._watch.start()
        return self

    async def close(self) -> None:
        await self._watch.close()

    async def _record(self, type_: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        now = time.monotonic()
        self._n += 1
        self.seq[name] = self._n
        self.latest[name] = obj
        status = obj.get("status") or {}
        phase = status.get("phase")
        seen = self.phases.setdefault(name, [])
        if phase and (not seen or seen[-1] != phase):
            seen.append(phase)
        if phase:
            self.phase_at.setdefault(name, {}).setdefault(phase, now)
        for cond in status.get("conditions") or []:
            if cond.get("status") == "True":
                self.true_at.setdefault(name, {}).setdefault(cond.get("type"), now)
        if type_ == "DELETED":
            self.gone[name] = now
        async with self._changed:
            self._changed.notify_all()

    def status(self, name: str) -> dict:
        return (self.latest.get(name) or {}).get("status") or {}

    def condition(self, name: str, type_: str) -> dict | None:
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), None)

    def first_seen(self, name: str, phases: tuple[str, ...]) -> float | None:
        """When the job was first seen in any of `phases` (None: not yet)."""
        times = [t for p, t in self.phase_at.get(name, {}).items() if p in phases]
        return min(times) if times else None

    async def wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Until `predicate()` holds (re-checked on every event)."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                raise TimeoutError(f"{what} not reached in {timeout}s") from None

    async def wait_phase(self, name: str, phase: str, timeout: float = 30) -> dict:
        await self.wait(lambda: self.status(name).get("phase") == phase, timeout, f"{name} phase {phase}")
        return self.status(name)
