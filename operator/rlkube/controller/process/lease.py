"""Leader election on a coordination.k8s.io/v1 Lease: the pure decisions (no I/O, clocks passed in).

The rules are client-go's (k8s.io/client-go/tools/leaderelection), which kube-controller-manager,
controller-runtime and every operator built on them follow, so an rlkube Lease reads like any other:
- a candidate never compares its clock with another process's: a Lease held by someone else counts as expired
  only when the candidate has seen the same record (holder, renewTime, ...) unchanged for
  `leaseDurationSeconds` on its own monotonic clock (`observe` keeps when the record last changed);
- the holder renews every retry period and gives up leading when it has not renewed for `renew_deadline`,
  which is shorter than the lease duration: it stops before anyone else may start;
- a released Lease (no holder) is free at once: a graceful shutdown hands over in one retry period;
- `leaseTransitions` counts changes of holder.
The writes themselves (create, or a replace carrying the read resourceVersion, so two candidates racing for an
expired Lease cannot both win) are in election.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal


@dataclass(frozen=True)
class Timing:
    """Seconds; client-go's defaults (kube-controller-manager runs with the same)."""

    lease_duration: float = 15.0
    """How long a standby waits on an unchanged Lease before it takes it."""
    renew_deadline: float = 10.0
    """How long the leader keeps trying to renew before it stops leading."""
    retry_period: float = 2.0
    """Between renewals of the leader, and between attempts of a standby."""

    def __post_init__(self) -> None:
        # The margins that make it safe: the leader stops (renew_deadline) before a standby may take over
        # (lease_duration), and the leader has room for more than one renewal attempt.
        if not self.lease_duration > self.renew_deadline:
            raise ValueError(f"lease duration ({self.lease_duration}s) must exceed the renew deadline "
                             f"({self.renew_deadline}s)")
        if not self.renew_deadline > 1.2 * self.retry_period:
            raise ValueError(f"renew deadline ({self.renew_deadline}s) must exceed 1.2 x the retry period "
                             f"({self.retry_period}s)")
        if self.retry_period <= 0:
            raise ValueError("retry period must be positive")


@dataclass(frozen=True)
class LeaseRecord:
    """The election fields of a Lease's spec (and the resourceVersion a replace must carry)."""

    holder: str = ""
    duration_seconds: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0
    resource_version: str | None = None

    @classmethod
    def from_lease(cls, lease: dict[str, Any]) -> LeaseRecord:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        )

    def same_election(self, other: LeaseRecord) -> bool:
        """Same record apart from the resourceVersion (what "unchanged" means for expiry)."""
        return (self.holder, self.duration_seconds, self.acquire_time, self.renew_time, self.transitions) == (
            other.holder, other.duration_seconds, other.acquire_time, other.renew_time, other.transitions)


@dataclass(frozen=True)
class Seen:
    """The Lease as this candidate last read it, and when (its monotonic clock) that record first appeared."""

    record: LeaseRecord
    since: float


def observe(previous: Seen | None, record: LeaseRecord, now: float) -> Seen:
    """Remember `record`; its clock restarts only when the election fields changed."""
    if previous is not None and previous.record.same_election(record):
        return Seen(record, previous.since)
    return Seen(record, now)


Kind = Literal["create", "acquire", "renew", "wait"]


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    spec: dict[str, Any] | None = None
    """The Lease spec to write (create / acquire / renew)."""
    expires_at: float | None = None
    """`wait`: when (monotonic) the current holder's Lease runs out unless it renews."""


def micro_time(wall: datetime) -> str:
    """A Kubernetes MicroTime: RFC 3339 in UTC with exactly six fractional digits (the API server insists)."""
    return wall.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def decide(identity: str, seen: Seen | None, now: float, wall: datetime, timing: Timing) -> Verdict:
    """What a candidate does with the Lease it just read (`seen` None: there is no Lease yet)."""
    duration = max(1, round(timing.lease_duration))
    stamp = micro_time(wall)
    if seen is None:
        return Verdict("create", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                                  "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0})
    record = seen.record
    if record.holder == identity:
        return Verdict("renew", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                                 "acquireTime": record.acquire_time or stamp, "renewTime": stamp,
                                 "leaseTransitions": record.transitions})
    # The holder's own duration counts (it may run with other settings); a record without one uses ours.
    expires_at = seen.since + (record.duration_seconds or duration)
    if record.holder and now < expires_at:
        return Verdict("wait", expires_at=expires_at)
    return Verdict("acquire", {"holderIdentity": identity, "leaseDurationSeconds": duration,
                               "acquireTime": stamp, "renewTime": stamp,
                               "leaseTransitions": record.transitions + 1})


def release_spec(record: LeaseRecord, wall: datetime) -> dict[str, Any]:
    """What the leader writes when it stops on purpose: no holder, so a standby takes the Lease at once.

    As client-go's ReleaseOnCancel: the duration drops to 1 s so candidates that only look at expiry also move on.
    """
    stamp = micro_time(wall)
    return {"leaseDurationSeconds": 1, "acquireTime": stamp, "renewTime": stamp,
            "leaseTransitions": record.transitions}


def leading_lost(last_renewed: float, now: float, timing: Timing) -> bool:
    """The leader has not renewed within the renew deadline: it must stop acting now (a standby may take the
    Lease `lease_duration` after it last saw a renewal, which is later)."""
    return now - last_renewed >= timing.renew_deadline
