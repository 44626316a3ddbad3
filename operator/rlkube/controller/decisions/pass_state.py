"""One reconcile pass's state: the job as the pass sees it (`JobView`), its mutable scratch state (`Pass`), and
what it returns (`Decision`).

Apart from the recipe (recipe.py) so that the step modules import the state without importing the recipe that
imports them; `outcome` and `set_phase` are here because nearly every step reads the outcome or moves the phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rlkube.api.role import Role
from rlkube.api.spec import TrainingJobSpec
from rlkube.api.status import TrainingJobStatus
from rlkube.controller.decisions import kueue
from rlkube.controller.decisions.actions import Action, Event
from rlkube.controller.decisions.conditions import is_true, set_condition
from rlkube.controller.decisions.observed import Observed, PodView
from rlkube.controller.manifests import builders
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, EventType, Phase


@dataclass(frozen=True)
class JobView:
    """The TrainingJob as one pass sees it."""

    namespace: str
    name: str
    uid: str
    generation: int
    raw_spec: dict[str, Any]
    spec: TrainingJobSpec | None
    """None when the spec failed semantic validation (then `spec_error` says why)."""
    spec_error: str | None
    deleting: bool
    status: TrainingJobStatus

    @property
    def ref(self) -> builders.JobRef:
        assert self.spec is not None
        return builders.JobRef(self.namespace, self.name, self.uid, self.spec, self.raw_spec)


@dataclass
class Decision:
    status: TrainingJobStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """Seconds until a time-based rule can fire (grace period, completion or stall timeout, TTL)."""
    watch_events: bool = False
    """Whether the job's Redis event stream should be read now."""
    released: bool = False
    """The ordered teardown has finished (what a deletion waits for)."""
    finished: bool = False
    """Terminal and released with nothing left to wait for: the per-job loop may stop."""
    teardown_seconds: float | None = None
    """Set on the pass that finished a teardown: how long it took (for the metrics)."""


def outcome(status: TrainingJobStatus) -> Phase | None:
    """The decided outcome (one of Phase.TERMINAL, recorded as the condition of the same name), or None while
    undecided. At most one is ever True: an outcome is decided once (`Pass.decide_outcome`)."""
    return next((phase for phase in Phase.TERMINAL if is_true(status.conditions, ConditionType(phase))), None)


class Pass:
    """Mutable scratch state of one decision; `decide` orchestrates the steps below."""

    def __init__(self, job: JobView, live: JobView, obs: Observed, now: datetime, gate: kueue.Gate, resuming: bool):
        self.job = job
        """The job as its pods run it (the spec it started with; `as_started`)."""
        self.live_job = live
        """The job as the API server has it now (what spec changes are reported against)."""
        self.gate = gate
        """The Kueue gate of this pass: while it holds, the job is suspended."""
        self.resuming = resuming
        """A finished suspend whose flag was cleared: this pass starts the job again from the spec as it is now."""
        self.spec = job.spec
        self.obs = obs
        self.now = now
        self.status = job.status.model_copy(deep=True)
        self.was_phase = job.status.phase
        self.stop_reason: str | None = None
        """Why the job is being torn down in this pass (an outcome, Deleted or Suspended); None while it runs."""
        self.released = False
        """The ordered teardown has finished."""
        self.watching = False
        """The job's Redis event stream should be read now."""
        self.actions: list[Action] = []
        self.events: list[Event] = []
        self.deadline: datetime | None = None
        self.replaced_now: set[str] = set()
        self.trainer_failed_now = False
        self.teardown_seconds: float | None = None
        self.accepting = False
        """A new job's first pass: its phase Event says the job is accepted."""
        self.released_note = ""
        """Set by the pass whose teardown finished: what it took (stage by stage)."""
        self.fresh = job.status.start_time is None
        """This pass creates the children for the first time (a new job, or a resume): nothing is "recreated"."""

    # -- helpers ------------------------------------------------------------------------------------

    def event(self, type_: str, reason: str, message: str) -> None:
        self.events.append(Event(type_, reason, message))

    def condition(self, type_: ConditionType, status: str, reason: str, message: str = "", event: bool = True) -> None:
        changed = set_condition(self.status.conditions, type_, status, reason, message, self.now, self.job.generation)
        if changed and event:
            bad = (status == ConditionStatus.TRUE and type_ in (ConditionType.FAILED, ConditionType.STALLED)) or (
                status == ConditionStatus.FALSE and type_ == ConditionType.EVENT_SOURCE_REACHABLE
            )
            self.event(EventType.WARNING if bad else EventType.NORMAL, reason,
                       f"{type_}={status}: {message}".rstrip(": "))

    def wake_at(self, when: datetime) -> None:
        if self.deadline is None or when < self.deadline:
            self.deadline = when

    def live(self, role: str) -> list[PodView]:
        return [p for p in self.obs.role_pods(role) if not p.deleting]

    def rank0(self) -> PodView | None:
        return next((p for p in self.live(Role.TRAINER) if p.index == 0), None)

    def decide_outcome(self, phase: Phase, reason: str, message: str) -> None:
        """Record the outcome (once, never changed) as the condition named like the terminal phase."""
        if outcome(self.status) is not None:
            return
        # Succeeded needs no Event of its own: the phase transitions (-> Draining, -> Succeeded) carry its reason.
        self.condition(ConditionType(phase), ConditionStatus.TRUE, reason, message, event=phase != Phase.SUCCEEDED)
        self.status.reason = reason
        self.status.message = message

    @property
    def max_steps(self) -> int:
        return self.spec.algorithm.max_steps if self.spec else 0

    @property
    def ttl(self) -> int | None:
        """runPolicy.ttlSecondsAfterFinished."""
        return self.spec.run_policy.ttl_seconds_after_finished if self.spec else None


def set_phase(p: Pass, phase: Phase, reason: str, message: str = "", note: str = "") -> None:
    """Set the phase; a change gets an Event, which also says `note` (not kept in the status)."""
    st = p.status
    if st.phase != phase or p.accepting:
        change = f"accepted, {phase}" if p.accepting else f"{st.phase} -> {phase}"
        p.accepting = False
        text = f"{change}: {reason} {message}".strip() + (f"; {note}" if note else "")
        p.event(EventType.WARNING if phase == Phase.FAILED else EventType.NORMAL, phase, text)
    st.phase = phase
    st.reason = reason
    st.message = message
