"""Hypothesis strategies for trainer event streams as a careless or hostile producer could write them, and an
oracle for what may complete a job, written from the wire contract (docs/design.md §4.1, §5.2) rather than from
the code that reads the events.

A stream is a list of `Entry`: the raw field map of one XADD and, sometimes, an explicit stream id (ids must
grow, so explicit ids are drawn as increasing millisecond stamps, some far beyond year 9999). Entries are:
well-typed events of every known type whose fields carry values of any JSON type (and extreme numbers),
raw JSON texts with numbers no double holds, JSON that is not an object, bytes that are not JSON (or not
UTF-8), entries without the `event` field, unknown types, oversized payloads, and duplicates of earlier entries.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
from hypothesis import strategies as st

from rlkube.contract import protocol

KNOWN = protocol.EVENT_TYPES
INT64 = (-(2**63), 2**63 - 1)
FIELDS = ("step", "documents_seen", "version", "lag", "lag_max", "path", "checkpoint", "interrupted", "loss", "tracker",
          "message")


@dataclass(frozen=True)
class Entry:
    fields: dict[str, bytes]
    ms: int | None = None
    """Explicit stream id `{ms}-0` (None: Redis picks `*`)."""
    label: str = ""
    """What kind of entry this is (printed in the summary)."""

    def __repr__(self) -> str:  # hypothesis prints failing cases: keep oversized payloads readable
        def short(v: bytes) -> str:
            return repr(v) if len(v) <= 120 else f"{v[:100]!r}...({len(v)} bytes)"
        fields = ", ".join(f"{k!r}: {short(v)}" for k, v in self.fields.items())
        return f"Entry({{{fields}}}, ms={self.ms}, label={self.label!r})"


# -- values -----------------------------------------------------------------------------------------------

extreme_ints = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**53 + 1, *INT64, 2**63, 2**64 - 1])
numbers = st.one_of(
    st.integers(-5, 200),
    extreme_ints,
    st.floats(allow_nan=False, allow_infinity=False),
)
text = st.text(max_size=40)
scalars = st.one_of(numbers, st.booleans(), st.none(), text)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(text, inner, max_size=3)), max_leaves=8)


def field_values(max_steps: int) -> st.SearchStrategy:
    """Values for a payload field: often plausible (around maxSteps, a path), often anything JSON holds."""
    plausible = st.one_of(st.integers(max_steps - 2, max_steps + 2), st.just(f"/checkpoints/step-{max_steps}"),
                          st.just(True), st.just(False), st.just(float(max_steps)))
    return st.one_of(plausible, json_values)


# -- entries ----------------------------------------------------------------------------------------------


def _event(payload: dict[str, Any]) -> dict[str, bytes]:
    return {protocol.EVENT_FIELD: orjson.dumps(payload)}


@st.composite
def typed_event(draw, max_steps: int) -> Entry:
    type_ = draw(st.sampled_from(KNOWN))
    keys = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=5))
    payload = {"type": type_, **{k: draw(field_values(max_steps)) for k in keys}}
    if draw(st.booleans()):
        payload = {k: v for k, v in payload.items()}  # key order as drawn ("type" first, as Fast-LLM writes)
    else:
        payload = dict(reversed(list(payload.items())))
    return Entry(_event(payload), label=f"typed:{type_}")


@st.composite
def raw_number_text(draw, max_steps: int) -> Entry:
    """JSON texts whose numbers are out of a double's or an int64's range, or written in exponent form."""
    type_ = draw(st.sampled_from(KNOWN))
    key = draw(st.sampled_from(("step", "version", "documents_seen", "lag_max")))
    number = draw(st.one_of(
        st.integers(-(10**30), 10**30).map(str),
        st.sampled_from(["1e400", "-1e400", "1e308", "4e1", f"{max_steps}.0", f"{max_steps}e0", "-0",
                         "18446744073709551616", "9223372036854775808", "-9223372036854775809"]),
    ))
    raw = f'{{"type": "{type_}", "{key}": {number}, "checkpoint": "/c"}}'.encode()
    return Entry({protocol.EVENT_FIELD: raw}, label="raw-number")


not_an_object = st.builds(lambda v: Entry({protocol.EVENT_FIELD: orjson.dumps(v)}, label="non-object"),
                          st.one_of(scalars, st.lists(scalars, max_size=3)))
not_json = st.builds(lambda b: Entry({protocol.EVENT_FIELD: b}, label="not-json"),
                     st.one_of(st.binary(max_size=30), st.sampled_from([b"{nope", b'{"type": "training_finished"',
                                                                        b'{"type": "\xff\xfe"}', b"NaN", b""])))
no_event_field = st.builds(
    lambda k, v: Entry({k: v}, label="no-event-field"),
    st.sampled_from(["evnt", "Event", "events", "type", "data"]),
    st.sampled_from([orjson.dumps({"type": "training_finished", "step": 10**6}), b"x"]),
)
bad_type = st.builds(
    lambda t: Entry(_event({"type": t, "step": 10**6, "checkpoint": "/c"}), label="bad-type"),
    st.one_of(st.sampled_from(["Training_Finished", "training_finished ", "TRAINING_FINISHED", "finished", ""]),
              st.text(max_size=12), st.integers(-(2**63), 2**63), st.none(),
              st.lists(st.just("training_finished"), max_size=2)),
)


@st.composite
def oversized(draw, max_steps: int) -> Entry:
    """Payloads far beyond any real event: a long checkpoint path or metrics blob (256 KiB to 2 MiB)."""
    size = draw(st.sampled_from([2**18, 2**20, 2**21]))
    type_ = draw(st.sampled_from(KNOWN))
    key = draw(st.sampled_from(("checkpoint", "path", "loss", "blob")))
    payload = {"type": type_, "step": max_steps, key: "/" + "x" * size}
    return Entry(_event(payload), label=f"oversized:{type_}:{key}")


def entries(max_steps: int) -> st.SearchStrategy[Entry]:
    return st.one_of(
        typed_event(max_steps), typed_event(max_steps), typed_event(max_steps),
        raw_number_text(max_steps), not_an_object, not_json, no_event_field, bad_type,
    )


@st.composite
def event_stream(draw, max_steps: int) -> list[Entry]:
    """Entries in order, with duplicates of earlier entries, an oversized one now and then, and some explicit
    (increasing) ids."""
    out = draw(st.lists(entries(max_steps), max_size=30))
    if draw(st.integers(0, 9)) == 0:
        out.insert(draw(st.integers(0, len(out))), draw(oversized(max_steps)))
    for _ in range(draw(st.integers(0, 4))):
        if out:
            dup = out[draw(st.integers(0, len(out) - 1))]
            out.insert(draw(st.integers(0, len(out))), Entry(dup.fields, label="duplicate:" + dup.label))
    if draw(st.integers(0, 4)) == 0 and out:
        # Explicit ids from some position on: far past (1970), now-ish, or beyond what datetime holds.
        start = draw(st.integers(0, len(out) - 1))
        ms = draw(st.sampled_from([1, 1_700_000_000_000, 253_402_300_800_000, 2**62]))
        for i in range(start, len(out)):
            ms += draw(st.integers(1, 10**6))
            out[i] = Entry(out[i].fields, ms, out[i].label)
    return out


# -- the oracle ---------------------------------------------------------------------------------------------


def _strict_json(raw: bytes) -> Any:
    """RFC 8259 JSON (no NaN/Infinity, numbers a double holds), or None."""
    def no_constant(name: str) -> Any:
        raise ValueError(name)

    try:
        value = json.loads(raw.decode("utf-8"), parse_constant=no_constant)
    except (UnicodeDecodeError, ValueError):
        return None
    return value


def _payload(fields: dict) -> dict | None:
    raw = fields.get(protocol.EVENT_FIELD)
    payload = _strict_json(raw) if isinstance(raw, bytes) else None
    return payload if isinstance(payload, dict) and payload.get("type") in KNOWN else None


def _reaches(step: Any, max_steps: int) -> bool:
    return not isinstance(step, bool) and isinstance(step, int | float) and step >= max_steps


def full_finish(fields: dict, max_steps: int, earlier: list[dict]) -> dict | None:
    """The payload of a well-formed training_finished for the final step (the only entry that can complete a
    job), or None. Well-formed: the `event` field holds a JSON object of type training_finished that does not
    say it was interrupted, whose `step` is a number (not a bool) of at least maxSteps, or which has no `step`
    (Fast-LLM's finish) after some earlier event (`earlier`: the fields of the entries before it) reported a
    step of at least maxSteps."""
    payload = _payload(fields)
    if payload is None or payload["type"] != protocol.TRAINING_FINISHED or payload.get("interrupted"):
        return None
    if "step" in payload:
        return payload if _reaches(payload["step"], max_steps) else None
    before = (_payload(f) for f in earlier)
    return payload if any(p is not None and _reaches(p.get("step"), max_steps) for p in before) else None
