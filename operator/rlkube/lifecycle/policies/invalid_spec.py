"""A spec the schema could not reject (two fields at once, quantities, ...): Failed, and nothing is started."""

from __future__ import annotations

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    if ev.spec_error is None and spec is not None:
        return UNDECIDED
    return Verdict(Outcome.failed(Reason.INVALID_SPEC, ev.spec_error or "invalid spec"))
