"""A role that exited with runtime.EXIT_CONFIG found its input unusable (a model directory that is missing or of an
unsupported architecture, a dataset without the mapped field, ...). Restarting it cannot help, so the job fails at
once with the role's own message, which names the spec field, instead of restarting it until a budget runs out.
A trainer that lost its checkpoints (rlkube.contract.checkpoint_loss) and a preprocessor whose groups are all filtered
for zero advantage (rlkube.contract.zero_advantage) are such roles, each with its own reason."""

from __future__ import annotations

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import checkpoint_loss, zero_advantage
from rlkube.lifecycle.evidence import Evidence
from rlkube.lifecycle.phases import Reason
from rlkube.lifecycle.verdict import UNDECIDED, Outcome, Verdict


def check(ev: Evidence, spec: TrainingJobSpec | None) -> Verdict:
    f = ev.config_error
    if f is None:
        return UNDECIDED
    if checkpoint_loss.is_loss(f.message):
        reason = Reason.CHECKPOINT_LOST
    elif zero_advantage.is_stall(f.message):
        reason = Reason.ZERO_ADVANTAGE_STALL
    else:
        reason = Reason.INVALID_SPEC
    return Verdict(Outcome.failed(reason, f"{f.role} {f.name} cannot run: {f.message or 'bad input'}"))
