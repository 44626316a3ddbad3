"""A role that exited with runtime.EXIT_CONFIG found its input unusable (a model directory that is missing or of an
unsupported architecture, a dataset without the mapped field, ...). Restarting it cannot help, so the job fails at
once with the role's own message, which names the spec field, instead of restarting it until a budget runs out."""

from __future__ import annotations

from rlkube.api.spec import TrainingJobSpec
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    f = ev.config_error
    if f is None:
        return UNDECIDED
    return Verdict(Outcome.failed(Reason.INVALID_SPEC, f"{f.role} {f.name} cannot run: {f.message or 'bad input'}"))
