"""RFC 3339 times as the status stores them, and Redis stream ids as times.

Status times carry milliseconds (metav1.Time has whole seconds) because teardown stages of a fast job
start and finish within the same second and their order must stay visible.
"""

from __future__ import annotations

from datetime import UTC, datetime

from rlkube.contract.protocol import stream_id_key

__all__ = ["fmt_time", "now", "parse_time", "stream_id_key", "stream_id_time"]


def now() -> datetime:
    return datetime.now(UTC)


def fmt_time(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value).astimezone(UTC)


def stream_id_time(stream_id: str) -> datetime:
    """The wall-clock time Redis stamped on an entry (`<ms>-<seq>`). A producer may XADD explicit ids up to 2**64-1
    ms; those beyond what datetime holds (year 9999) read as datetime.max."""
    try:
        return datetime.fromtimestamp(int(stream_id.split("-", 1)[0]) / 1000, UTC)
    except (ValueError, OverflowError, OSError):
        return datetime.max.replace(tzinfo=UTC)


