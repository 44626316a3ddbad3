"""The pure leader election decisions (rlkube.controller.process.lease): create, acquire, renew, wait, expiry measured
on the candidate's own clock, release, and the leader's renew deadline. Clocks are passed in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from rlkube.controller.process.lease import (
    LeaseRecord,
    Seen,
    Timing,
    decide,
    leading_lost,
    micro_time,
    observe,
    release_spec,
)

T = Timing()  # 15 / 10 / 2
WALL = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def lease(holder: str | None, renew: str = "2025-01-02T03:04:00.000000Z", transitions: int = 0, rv: str = "7",
          duration: int = 15) -> dict:
    spec = {"leaseDurationSeconds": duration, "acquireTime": "2025-01-02T03:00:00.000000Z", "renewTime": renew,
            "leaseTransitions": transitions}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"metadata": {"name": "l", "namespace": "ns", "resourceVersion": rv}, "spec": spec}


def seen(doc: dict, since: float) -> Seen:
    return Seen(LeaseRecord.from_lease(doc), since)


def test_no_lease_is_created_held_by_the_candidate():
    v = decide("me", None, now=100.0, wall=WALL, timing=T)
    assert v.kind == "create"
    assert v.spec == {"holderIdentity": "me", "leaseDurationSeconds": 15, "acquireTime": "2025-01-02T03:04:05.000000Z",
                      "renewTime": "2025-01-02T03:04:05.000000Z", "leaseTransitions": 0}


def test_the_holder_renews_keeping_its_acquire_time_and_transitions():
    v = decide("me", seen(lease("me", transitions=3), since=50.0), now=100.0, wall=WALL, timing=T)
    assert v.kind == "renew"
    assert v.spec["acquireTime"] == "2025-01-02T03:00:00.000000Z"  # when it became leader, not now
    assert v.spec["renewTime"] == "2025-01-02T03:04:05.000000Z"
    assert v.spec["leaseTransitions"] == 3 and v.spec["holderIdentity"] == "me"


def test_a_live_lease_of_another_holder_is_waited_on_until_it_expires_on_our_clock():
    s = seen(lease("other"), since=100.0)
    for now in (100.0, 107.0, 114.99):
        v = decide("me", s, now=now, wall=WALL, timing=T)
        assert v.kind == "wait" and v.expires_at == 115.0
    v = decide("me", s, now=115.0, wall=WALL, timing=T)
    assert v.kind == "acquire"
    assert v.spec["holderIdentity"] == "me" and v.spec["leaseTransitions"] == 1
    assert v.spec["acquireTime"] == v.spec["renewTime"] == "2025-01-02T03:04:05.000000Z"


def test_the_lease_renewTime_is_never_compared_with_our_wall_clock():
    # A renewTime hours in the past (the holder's clock is behind, or ours ahead) does not make it expired:
    # only time we watched the record stay unchanged counts.
    s = seen(lease("other", renew="2000-01-01T00:00:00.000000Z"), since=100.0)
    assert decide("me", s, now=101.0, wall=WALL, timing=T).kind == "wait"


def test_observe_restarts_the_clock_only_when_the_record_changes():
    first = observe(None, LeaseRecord.from_lease(lease("other")), now=100.0)
    assert first.since == 100.0
    # The same record read again (even with another resourceVersion): the clock keeps running from 100.
    again = observe(first, LeaseRecord.from_lease(lease("other", rv="8")), now=110.0)
    assert again.since == 100.0 and again.record.resource_version == "8"
    assert decide("me", again, now=115.0, wall=WALL, timing=T).kind == "acquire"
    # A renewal by the holder restarts it: the holder is alive.
    renewed = observe(again, LeaseRecord.from_lease(lease("other", renew="2025-01-02T03:04:02.000000Z")), now=112.0)
    assert renewed.since == 112.0
    assert decide("me", renewed, now=115.0, wall=WALL, timing=T).kind == "wait"
    # A new holder restarts it too.
    taken = observe(renewed, LeaseRecord.from_lease(lease("third", renew="2025-01-02T03:04:02.000000Z")), now=113.0)
    assert taken.since == 113.0


def test_the_holders_own_lease_duration_counts():
    s = seen(lease("other", duration=60), since=100.0)
    assert decide("me", s, now=130.0, wall=WALL, timing=T).kind == "wait"
    assert decide("me", s, now=160.0, wall=WALL, timing=T).kind == "acquire"


def test_a_released_lease_is_taken_at_once():
    released = {"metadata": {"resourceVersion": "9"},
                "spec": release_spec(LeaseRecord.from_lease(lease("other", transitions=4)), WALL)}
    assert "holderIdentity" not in released["spec"] and released["spec"]["leaseDurationSeconds"] == 1
    assert released["spec"]["leaseTransitions"] == 4
    v = decide("me", seen(released, since=100.0), now=100.0, wall=WALL, timing=T)
    assert v.kind == "acquire" and v.spec["leaseTransitions"] == 5
    # An empty holder string (as other clients may write) is the same as none.
    v = decide("me", seen(lease(""), since=100.0), now=100.0, wall=WALL, timing=T)
    assert v.kind == "acquire"


def test_the_leader_stops_before_a_standby_may_take_over():
    # Last renewal at 100: the leader gives up at 110 (renew deadline); a standby that saw that renewal at the
    # same instant may take over at 115 at the earliest.
    assert not leading_lost(100.0, 109.9, T)
    assert leading_lost(100.0, 110.0, T)
    s = seen(lease("leader"), since=100.0)
    assert decide("standby", s, now=110.0, wall=WALL, timing=T).kind == "wait"


@pytest.mark.parametrize("kwargs", [
    {"lease_duration": 10, "renew_deadline": 10},
    {"renew_deadline": 2.4, "retry_period": 2},
    {"retry_period": 0, "renew_deadline": 1, "lease_duration": 2},
])
def test_unsafe_timings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Timing(**kwargs)


def test_micro_time_has_six_fractional_digits_in_utc():
    assert micro_time(WALL) == "2025-01-02T03:04:05.000000Z"
    east = datetime(2025, 1, 2, 5, 4, 5, 123, tzinfo=UTC).astimezone(timezone(timedelta(hours=2)))
    assert micro_time(east) == "2025-01-02T05:04:05.000123Z"
