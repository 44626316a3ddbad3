"""The spec a job acts on: the one it started with (status.startedSpec, decisions/specdiff.py), changes to it
reported and not applied, and a finished suspend resumed with the spec as it is now (docs/design.md §4.5).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import orjson

from rlkube.controller.decisions import kueue, specdiff, teardown
from rlkube.controller.decisions.conditions import get, remove
from rlkube.controller.decisions.pass_state import JobView, Pass, set_phase
from rlkube.lifecycle.phases import ConditionStatus, ConditionType, EventType, Phase, Reason
from rlkube.lifecycle.validation import SpecError, parse_spec


def can_resume(job: JobView, gate: kueue.Gate) -> bool:
    st = job.status
    return (
        st.phase == Phase.SUSPENDED
        and st.teardown is not None
        and st.teardown.stage == teardown.DONE
        and job.spec is not None
        and not job.spec.run_policy.suspend
        and not gate.hold
        and not job.deleting
    )


def as_started(live: JobView) -> JobView:
    """The job as its pods run it: the spec it started with, runPolicy.suspend (and deletion) as they are now."""
    started = live.status.started_spec
    if started is None:
        return live
    raw = specdiff.with_live_fields(started, live.raw_spec)
    spec = _parse_started(orjson.dumps(raw, option=orjson.OPT_SORT_KEYS))
    if spec is None:
        return live  # recorded by an operator whose schema differed: act on the current spec
    return replace(live, raw_spec=raw, spec=spec, spec_error=None)


@functools.lru_cache(maxsize=1024)
def _parse_started(raw_json: bytes) -> Any:
    """The started spec, validated once per distinct spec rather than on every pass (a pure function of the
    JSON, and nothing modifies a parsed spec); None when it does not validate."""
    try:
        return parse_spec(orjson.loads(raw_json))
    except SpecError:
        return None


def report_spec_changes(p: Pass) -> None:
    """Spec changes while the job runs are not applied: one Warning Event per distinct set of ignored changes, and
    the condition SpecChangeIgnored says which while they last."""
    st = p.status
    live = p.live_job
    suspending = bool((live.raw_spec.get("runPolicy") or {}).get("suspend"))
    if st.started_spec is None or st.phase not in (Phase.PENDING, Phase.STARTING, Phase.RUNNING, Phase.DRAINING) or live.deleting:
        return
    if suspending:
        return  # the change is applied when the job resumes: nothing is ignored
    paths = specdiff.changed_paths(st.started_spec, live.raw_spec)
    previous = get(st.conditions, ConditionType.SPEC_CHANGE_IGNORED)
    if paths:
        message = (
            f"{specdiff.describe(paths)} changed after the job started (generation {st.started_generation} -> "
            f"{live.generation}); not applied to the running job (suspend and resume it to apply)"
        )
        # The generations in the message change with every edit; the Event only when the paths do.
        if (previous is None or previous.status != ConditionStatus.TRUE
                or not previous.message.startswith(specdiff.describe(paths) + " ")):
            p.event(EventType.WARNING, Reason.SPEC_CHANGE_IGNORED, message)
        p.condition(ConditionType.SPEC_CHANGE_IGNORED, ConditionStatus.TRUE, Reason.SPEC_CHANGE_IGNORED, message,
                    event=False)
    elif previous is not None and previous.status == ConditionStatus.TRUE:
        p.condition(ConditionType.SPEC_CHANGE_IGNORED, ConditionStatus.FALSE, Reason.SPEC_AS_STARTED,
                    "the spec is back to the one the job started with", event=False)


def resume_from_suspend(p: Pass) -> None:
    st = p.status
    st.teardown = None
    st.completion = None
    st.running_since = None
    st.trainer.last_event_id = None  # the next Redis (and its streams) is a new one
    remove(st.conditions, ConditionType.RESOURCES_RELEASED)
    remove(st.conditions, ConditionType.STALLED)
    remove(st.conditions, ConditionType.SPEC_CHANGE_IGNORED)
    p.fresh = True
    why = p.gate.message if p.gate.reason else "spec.runPolicy.suspend unset"
    p.condition(ConditionType.SUSPENDED, ConditionStatus.FALSE, Reason.RESUMED, why)
    set_phase(p, Phase.PENDING, Reason.RESUMED, "recreating the components")
