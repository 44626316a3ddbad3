"""What the operator observes about one job, reduced to plain values the decisions can reason about.

`PodView` is the summary of one pod that the kopf index keeps (phase, readiness, exit codes, restarts), so
the decisions never touch raw Kubernetes objects and their tests build views directly. While the role's container
has never run, a failed init container (the model fetch) stands for it: its exit code, termination message and
restarts are the pod's, so runtime.EXIT_CONFIG and the restart budgets apply to it (no endless
Init:CrashLoopBackOff). `EventSource` is the
state of the Redis watcher. Pure parsing, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from rlkube.contract.protocol import TrainerEvent
from rlkube.controller.decisions.times import parse_time
from rlkube.controller.manifests import names
from rlkube.lifecycle.phases import ConditionStatus, PodPhase
from rlkube.lifecycle.roles import START_ORDER

if TYPE_CHECKING:
    from rlkube.controller.decisions.kueue import KueueObserved


@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    role: str
    index: int
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    restart_count: int = 0
    exit_code: int | None = None  # main container's current state.terminated.exitCode
    last_exit_code: int | None = None  # ... and lastState.terminated.exitCode (a container restarted in place)
    termination_message: str | None = None  # the newest terminated state's message (the role's termination log)
    finished_at: datetime | None = None  # ... and its finishedAt
    started_at: datetime | None = None  # when the current container instance started
    waiting_reason: str | None = None  # e.g. ErrImagePull, CrashLoopBackOff ("Init:" while an init container waits)
    waiting_message: str | None = None  # ... and the kubelet's message with it (e.g. the pull's error)
    pod_ip: str | None = None
    deleting: bool = False  # deletionTimestamp is set
    deletion_grace: int | None = None  # metadata.deletionGracePeriodSeconds (0: force-deleted)
    deletion_at: datetime | None = None  # metadata.deletionTimestamp: when the pod's grace period runs out
    attempt: int = 0  # rlkube.io/attempt annotation

    @property
    def terminated(self) -> bool:
        return self.phase in (PodPhase.SUCCEEDED, PodPhase.FAILED)

    @property
    def running(self) -> bool:
        return self.phase == PodPhase.RUNNING and not self.deleting


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def _ran(container: dict) -> bool:
    """The container has started at least once (it runs, ran, or waits to be restarted)."""
    return bool(_get(container, "state", "running") or _get(container, "state", "terminated")
                or _get(container, "lastState", "terminated") or container.get("restartCount"))


def _failed_init(status: dict, main: dict) -> dict | None:
    """The status of an init container that failed (now, or before a restart in place) while the main container
    never ran; None otherwise (no init container failed, or the role has started since)."""
    if _ran(main):
        return None
    for c in status.get("initContainerStatuses") or []:
        code = _get(c, "state", "terminated", "exitCode")
        if (code is not None and code != 0) or _get(c, "lastState", "terminated") or c.get("restartCount"):
            return c
    return None


def _waiting_init(status: dict, main: dict) -> dict | None:
    """The init container that holds the pod up while it waits (e.g. on its image pull) before the role's
    container has run; None otherwise. The role's own container then only says PodInitializing."""
    if _ran(main):
        return None
    for c in status.get("initContainerStatuses") or []:
        if _get(c, "state", "waiting", "reason") not in (None, "PodInitializing"):
            return c
    return None


def pod_view(pod: dict) -> PodView | None:
    """Summarise a pod dict (as the API returns it); None for pods without our role/index labels."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(names.LABEL_ROLE)
    try:
        index = int(labels.get(names.LABEL_INDEX, ""))
    except ValueError:
        return None
    if role not in START_ORDER:
        return None
    status = pod.get("status") or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == ConditionStatus.TRUE for c in conditions)
    # The main container is the one named after the role; fall back to the first one.
    statuses = status.get("containerStatuses") or []
    main = next((c for c in statuses if c.get("name") == role), statuses[0] if statuses else {})
    init = _failed_init(status, main)
    restarts = int(main.get("restartCount") or 0)
    waiting_prefix = ""
    if init is not None:
        # The role never ran because an init container (the model fetch) failed: its exit, message and restarts
        # are the pod's, so restart budgets and runtime.EXIT_CONFIG apply to it as to the role itself.
        restarts += int(init.get("restartCount") or 0)
        main, waiting_prefix = init, "Init:"
    elif (held := _waiting_init(status, main)) is not None:
        # Its waiting reason (an image pull, say) is the pod's; one that failed before is _failed_init's.
        main, waiting_prefix = held, "Init:"
    terminated = _get(main, "state", "terminated")
    last = _get(main, "lastState", "terminated")
    running = _get(main, "state", "running")
    waiting = _get(main, "state", "waiting")
    started = (running or {}).get("startedAt") or (terminated or {}).get("startedAt")
    try:
        attempt = int((meta.get("annotations") or {}).get(names.ANNOTATION_ATTEMPT, "0"))
    except ValueError:
        attempt = 0
    grace = meta.get("deletionGracePeriodSeconds")
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        index=index,
        phase=status.get("phase") or "Pending",
        ready=ready,
        restart_count=restarts,
        exit_code=terminated.get("exitCode") if terminated else None,
        last_exit_code=last.get("exitCode") if last else None,
        termination_message=((terminated or {}).get("message") or (last or {}).get("message") or "").strip() or None,
        finished_at=parse_time(terminated.get("finishedAt")) if terminated else None,
        started_at=parse_time(started),
        waiting_reason=waiting_prefix + reason if (reason := (waiting or {}).get("reason")) else None,
        waiting_message=((waiting or {}).get("message") or "").strip() or None,
        pod_ip=status.get("podIP") or None,
        deleting=bool(meta.get("deletionTimestamp")),
        deletion_grace=int(grace) if grace is not None else None,
        deletion_at=parse_time(meta.get("deletionTimestamp")),
        attempt=attempt,
    )


@dataclass(frozen=True)
class EventSource:
    """State of the job's Redis event watcher."""

    state: Literal["Unknown", "Reachable", "Unreachable"] = "Unknown"
    reason: str = "WaitingForRedis"
    message: str = ""
    caught_up: bool = False
    """The watcher has read the stream to its end since it (re)connected: a missing event is really missing
    (not merely unread, as right after an operator restart or a Redis outage)."""


@dataclass(frozen=True)
class Rejected:
    """A child the API server refused to create as invalid (400/422): retrying the same manifest cannot help."""

    kind: str
    name: str
    message: str
    """The API server's message; it names the offending field."""


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile pass knows besides the job object itself."""

    pods: tuple[PodView, ...] = ()
    events: tuple[TrainerEvent, ...] = ()
    """Trainer events read after status.trainer.lastEventId, in stream order."""
    read_upto: str | None = None
    """Last stream id the watcher read, malformed entries included (they are skipped, not re-read)."""
    event_source: EventSource = field(default_factory=EventSource)
    events_read_to_end: bool = False
    """This pass read the event stream to its end AFTER it observed `pods` (a fresh, successful read): an event
    missing from `events` is then really not in the stream, not merely unread (watcher lag, operator restart)."""
    static_present: frozenset[str] = frozenset()
    """`Kind/name` of the ConfigMap, Secret and Services that exist: kopf's watch of those kinds (by our labels),
    plus the ones this operator created that the watch has not delivered yet."""
    create_rejected: Rejected | None = None
    """A create of one of the job's children that the API server rejected as invalid (since the last pass)."""
    kueue: KueueObserved | None = None
    """The job's Kueue Workload and admitted flavours; None when the job has no kueue.x-k8s.io/queue-name."""

    def role_pods(self, role: str) -> list[PodView]:
        return sorted((p for p in self.pods if p.role == role), key=lambda p: p.index)
