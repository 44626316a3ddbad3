"""A pod's status as kubelet reports it, computed from what the agent knows about its containers.

Pure: the worker keeps one `Container` record per container and calls `pod_status()`; the rules for the
phase and the conditions are kubelet's (`getPhase`, `GeneratePodReadyCondition`, ...), so they are
unit-tested here without processes or an API server.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field


def rfc3339(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return dt.datetime.fromtimestamp(epoch, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def exit_code_of(returncode: int) -> tuple[int, int | None]:
    """Popen's returncode -> (exitCode, signal): killed by signal N reads as 128+N, as in a container."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


@dataclass
class Container:
    name: str
    image: str = ""
    init: bool = False
    state: str = "waiting"  # waiting | running | terminated
    reason: str | None = "ContainerCreating"
    message: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    restart_count: int = 0
    last_terminated: dict | None = None
    ready: bool = False
    started: bool = False  # startup probe passed (or none)
    pid: int | None = None
    has_readiness_probe: bool = False

    def terminated_dict(self) -> dict:
        d = {
            "exitCode": self.exit_code,
            "reason": self.reason or ("Completed" if self.exit_code == 0 else "Error"),
            "startedAt": rfc3339(self.started_at),
            "finishedAt": rfc3339(self.finished_at),
            "containerID": f"rlkube-agent://{self.pid}",
        }
        if self.signal:
            d["signal"] = self.signal
        if self.message:
            d["message"] = self.message
        return d

    def status(self) -> dict:
        if self.state == "running":
            state = {"running": {"startedAt": rfc3339(self.started_at)}}
        elif self.state == "terminated":
            state = {"terminated": self.terminated_dict()}
        else:
            state = {"waiting": {k: v for k, v in (("reason", self.reason), ("message", self.message)) if v}}
        d = {
            "name": self.name,
            "state": state,
            "lastState": {"terminated": self.last_terminated} if self.last_terminated else {},
            "ready": self.ready,
            "restartCount": self.restart_count,
            "image": self.image,
            "imageID": "",
            "started": self.state == "running" and self.started,
        }
        if self.pid is not None and self.state != "waiting":
            d["containerID"] = f"rlkube-agent://{self.pid}"
        return d


@dataclass
class PodView:
    """Everything besides the containers that goes into the status."""

    restart_policy: str
    init: list[Container] = field(default_factory=list)
    main: list[Container] = field(default_factory=list)
    pod_ip: str | None = None
    host_ip: str | None = None
    start_time: float | None = None
    failed_reason: str | None = None  # a pod-level failure (e.g. an init container under Never)
    failed_message: str | None = None


def phase(view: PodView) -> str:
    if view.failed_reason:
        return "Failed"
    for c in view.init:
        if c.state == "terminated" and c.exit_code != 0 and view.restart_policy == "Never":
            return "Failed"
    if any(not (c.state == "terminated" and c.exit_code == 0) for c in view.init):
        return "Pending"
    running = waiting = stopped = succeeded = 0
    for c in view.main:
        if c.state == "running":
            running += 1
        elif c.state == "terminated":
            stopped += 1
            succeeded += c.exit_code == 0
        elif c.last_terminated:  # waiting to restart: kubelet counts it as stopped
            stopped += 1
            succeeded += c.last_terminated.get("exitCode") == 0
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if view.restart_policy == "Always":
        return "Running"
    if stopped == succeeded:
        return "Succeeded"
    if view.restart_policy == "Never":
        return "Failed"
    return "Running"


def conditions(view: PodView, ph: str, previous: list[dict], now: float) -> list[dict]:
    """PodScheduled, Initialized, ContainersReady, Ready; lastTransitionTime kept while the status holds."""
    prev = {c.get("type"): c for c in previous or []}
    init_done = all(c.state == "terminated" and c.exit_code == 0 for c in view.init)
    unready = [c.name for c in view.main if not c.ready]
    out: list[tuple[str, bool, str | None, str | None]] = [("PodScheduled", True, None, None)]
    if init_done:
        out.append(("Initialized", True, None, None))
    else:
        pending = [c.name for c in view.init if not (c.state == "terminated" and c.exit_code == 0)]
        out.append(("Initialized", False, "ContainersNotInitialized", f"containers with incomplete status: {pending}"))
    if ph in ("Succeeded", "Failed"):
        out.append(("ContainersReady", False, "PodCompleted", None))
        out.append(("Ready", False, "PodCompleted", None))
    elif unready:
        msg = f"containers with unready status: [{' '.join(unready)}]"
        out.append(("ContainersReady", False, "ContainersNotReady", msg))
        out.append(("Ready", False, "ContainersNotReady", msg))
    else:
        out.append(("ContainersReady", True, None, None))
        out.append(("Ready", True, None, None))
    result = []
    for typ, ok, reason, message in out:
        status = "True" if ok else "False"
        old = prev.get(typ)
        changed_at = old.get("lastTransitionTime") if old and old.get("status") == status else rfc3339(now)
        cond = {"type": typ, "status": status, "lastProbeTime": None, "lastTransitionTime": changed_at}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        result.append(cond)
    return result


def pod_status(view: PodView, previous_conditions: list[dict], now: float) -> dict:
    ph = phase(view)
    status = {
        "phase": ph,
        "conditions": conditions(view, ph, previous_conditions, now),
        "hostIP": view.host_ip,
        "podIP": view.pod_ip,
        "podIPs": [{"ip": view.pod_ip}] if view.pod_ip else [],
        "startTime": rfc3339(view.start_time),
        "containerStatuses": [c.status() for c in view.main],
        "initContainerStatuses": [c.status() for c in view.init],
    }
    if view.failed_reason:
        status["reason"] = view.failed_reason
        status["message"] = view.failed_message
    return status
