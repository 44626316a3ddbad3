"""What the job loop reads from the API and writes back, as pure functions: the stored job and status parsed
for the decisions (`job_view`, `parse_status`), the status written as one merge patch per pass and which
patches may wait for a later one (`routine_patch`), and a pass's actions cut into waves that may run at once.

Apart from rlkube.controller.reconcile.loop so the loop holds only its I/O and timing; these are tested alone.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from pydantic import ValidationError

from rlkube.api.status import TrainingJobStatus
from rlkube.controller.decisions import teardown
from rlkube.controller.decisions.actions import Create, DeleteObject, DeletePod
from rlkube.controller.decisions.recipe import Decision, JobView
from rlkube.controller.manifests import names
from rlkube.controller.reconcile.apiclient import ApiError
from rlkube.lifecycle.validation import SpecError, parse_spec

log = logging.getLogger(__name__)

COALESCE_SECONDS = 3.0
"""How long a routine status change may wait to go out with a later pass's write (see `routine_patch`)."""
ROUTINE_KEYS = frozenset({"progress", "lag", "conditions", "components", "trainer", "completion"})
"""Status keys whose change alone is routine: readiness, the event source, trainer progress, the finished record.

Each TrainingJob status write is the API server's dearest request (the whole object is decoded, checked against
the CRD schema and its managed fields recomputed: at 200 jobs these writes were 28% of its CPU), and routine
changes come one per pass: the watcher's first connection, a component turning Ready, every metrics event of a
training step, training_finished a moment before the trainer's exit. Held for up to COALESCE_SECONDS they ride
with the next write. Nothing is lost if the operator stops meanwhile: the next one re-derives them (conditions
from the pods, progress and the finished record by reading the stream again from the last id written)."""


STATUS_KEYS = frozenset(f.alias or n for n, f in TrainingJobStatus.model_fields.items())


def routine_patch(patch: dict, decision: Decision) -> bool:
    """This status patch may wait (COALESCE_SECONDS) for a later pass to carry it.

    Routine: a change of ROUTINE_KEYS only, by a pass that creates nothing, replaces no pod (the restart it
    counts must be stored before anything else happens) and posts no Event; or, once the ordered teardown has
    begun (its first pass, which changes the phase, is written at once), the move from one stage to the next
    with its pod deletions. A stage's progress is re-derived from the pods if the operator stops meanwhile: a
    stage whose pods are gone finishes at once, pods already deleting are not deleted again (teardown.advance).
    Any change of phase, outcome or generation is written at once, and so is a pass's change when the pass
    itself wants to look again sooner than COALESCE_SECONDS: what it wrote may be the evidence of the outcome that
    the next pass decides (training_finished, then completionTimeoutSeconds without the trainer's exit).
    """
    if decision.events or not patch.keys() <= ROUTINE_KEYS | {"teardown"}:
        return False
    if decision.requeue_after is not None and decision.requeue_after < COALESCE_SECONDS:
        return False
    td = decision.status.teardown
    if td is not None and td.stage != teardown.DONE and td.stages:
        return all(isinstance(a, DeletePod) for a in decision.actions)
    return not decision.actions


def merge_patch(old: dict, new: dict) -> dict:
    """RFC 7386 merge patch turning `old` into `new` (None removes a key; lists are replaced whole)."""
    patch: dict = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif value != before:
            patch[key] = value
    for key in old:
        if key not in new:
            patch[key] = None
    return patch


def describe(action: Any) -> str:
    if isinstance(action, Create):
        return f"create {action.kind}/{action.name}"
    if isinstance(action, DeletePod):
        return f"{'force-' if action.force else ''}delete Pod/{action.name} (grace {action.grace_seconds}s)"
    if isinstance(action, DeleteObject):
        return f"delete {action.kind}/{action.name}"
    return type(action).__name__


def _wave_kind(action: Any) -> str | None:
    """Actions of the same wave kind may run concurrently; None: on its own."""
    if isinstance(action, Create):
        return "create-pod" if action.kind == "Pod" else "create-object"
    if isinstance(action, DeletePod | DeleteObject):
        return type(action).__name__
    return None


def waves(actions: list[Any]) -> list[list[Any]]:
    """The actions cut into runs of consecutive actions of one wave kind, in order."""
    out: list[list[Any]] = []
    for action in actions:
        kind = _wave_kind(action)
        if out and kind is not None and _wave_kind(out[-1][0]) == kind:
            out[-1].append(action)
        else:
            out.append([action])
    return out


def without_empty_strings(node: Any) -> Any:
    """Drop "" values: an absent optional field says the same, and the test cluster's kube-apiserver 1.20
    (built with Debian's json-iterator) turns "" into null inside merge patches and then rejects it."""
    if isinstance(node, dict):
        return {k: without_empty_strings(v) for k, v in node.items() if v != ""}
    if isinstance(node, list):
        return [without_empty_strings(v) for v in node]
    return node


def api_message(exc: ApiError) -> str:
    """The Status message of an API error (it names the field), else its reason."""
    try:
        message = orjson.loads(exc.body or b"").get("message")
    except (orjson.JSONDecodeError, AttributeError):
        message = None
    return str(message or exc.reason or exc.status)


def parse_status(raw: Any) -> TrainingJobStatus:
    """The stored status, ignoring fields that are not ours (kopf's bookkeeping, older versions)."""
    if not isinstance(raw, dict):
        return TrainingJobStatus()
    try:
        return TrainingJobStatus.model_validate({k: v for k, v in raw.items() if k in STATUS_KEYS})
    except ValidationError as exc:
        log.error("stored status unreadable, starting from an empty one: %s", exc)
        return TrainingJobStatus()


def parsed_spec(name: str, raw_spec: dict) -> tuple[Any, str | None]:
    """(spec, None) or (None, why it is invalid)."""
    try:
        spec = parse_spec(raw_spec)
    except SpecError as exc:
        return None, str(exc)
    if (bad_name := names.job_name_error(name, spec)) is not None:
        return None, bad_name
    return spec, None


def job_view(body: Any, status: TrainingJobStatus, parsed: tuple[Any, str | None] | None = None) -> JobView:
    """The job as the decisions see it; `parsed` is parsed_spec() of this body's spec when the caller has it."""
    meta = body["metadata"]
    raw_spec = dict(body.get("spec") or {})
    spec, error = parsed if parsed is not None else parsed_spec(meta["name"], raw_spec)
    return JobView(
        namespace=meta["namespace"],
        name=meta["name"],
        uid=meta["uid"],
        generation=int(meta.get("generation") or 0),
        raw_spec=raw_spec,
        spec=spec,
        spec_error=error,
        deleting=bool(meta.get("deletionTimestamp")),
        status=status,
    )
