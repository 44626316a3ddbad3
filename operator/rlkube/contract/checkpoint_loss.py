"""A restarted trainer resumes from the checkpoint the job already reported, or the job fails saying why.

Why: a trainer's checkpoints live on the volume of spec.trainer.checkpoint, an emptyDir unless `claimName` names a
PersistentVolumeClaim, and Kubernetes deletes an emptyDir with its pod. A trainer pod that is recreated
(restartPolicy Never, an eviction, a lost node, a suspended job that resumes) then finds no checkpoint and would
start again at step 0 while the job's status still names step N's checkpoint: all the job's progress lost without a
word. So the launcher tells a trainer it (re)starts which checkpoint it last saw saved, in
runtime.ENV_RESUME_CHECKPOINT (the operator from status.trainer.lastCheckpoint, the value of the trainer pod's
rlkube.io/resume-from-checkpoint annotation; `rlkube local` from the checkpoint_saved events it read), and a trainer
that resumes from no checkpoint, or from an older one, exits runtime.EXIT_CONFIG with `loss`'s message: a restart
cannot bring the volume back, so the config_error policy fails the job at once, with reason CheckpointLost (README,
"Run it on Kubernetes"). The operator warns at creation about a job that can get there (`ephemeral_warning`).
A Fast-LLM trainer (backend fast-llm) reports no checkpoints: its launcher, rlkube.core.launch.fast_llm, derives
the checkpoint it must find from the newest step the trainer announced in its events (`fast_llm_saved`) and makes
the same check before it starts Fast-LLM (docs/design.md §8).

Pure and written once: the operator, `rlkube local` and the trainer role all use these functions.
"""

from __future__ import annotations

import re

from rlkube.api.spec import TrainingJobSpec

FIELD = "spec.trainer.checkpoint.claimName"
"""What a user sets to keep checkpoints across trainer pods."""
_MARK = "checkpoint lost:"
_STEP = re.compile(r"(?:^|/)(?:step-(\d+)|checkpoint/(\d+))/?$")


def step_of(path: str) -> int | None:
    """The step of a checkpoint directory as rlkube.core.training.checkpoint names them (`.../step-000010`) or as
    Fast-LLM does (`{experiment_dir}/checkpoint/10`, fast_llm_checkpoint), else None."""
    m = _STEP.search(path or "")
    return int(m.group(1) or m.group(2)) if m else None


def fast_llm_checkpoint(experiment_dir: str, step: int) -> str:
    """Where Fast-LLM saves step `step`'s checkpoint (fast_llm/engine/training/config.py:143, `checkpoint/{step}`
    under `run.experiment_dir`, which rlkube.controller.manifests.fastllm sets to spec.trainer.checkpoint.path)."""
    return f"{experiment_dir.rstrip('/')}/checkpoint/{step}"


def fast_llm_saved(announced_step: int | None, interval: int) -> int | None:
    """The newest checkpoint step a Fast-LLM trainer certainly saved once it announced weights for
    `announced_step` (None: nothing announced); None when that is none. Fast-LLM saves a step's checkpoint at the
    end of the step, after its weights_ready (fast_llm/engine/training/trainer.py: callbacks' step_end, then
    `_save_checkpoint`), every `interval` steps: the announcement of step k proves the checkpoints of the
    steps before k. Neither Fast-LLM nor its trainer sends a checkpoint_saved event of its own."""
    if announced_step is None or interval < 1:
        return None
    saved = (announced_step - 1) // interval * interval
    return saved if saved > 0 else None


def loss(expected: str | None, resumed_step: int | None, checkpoint_dir: str) -> str | None:
    """None when a trainer that was told it saved checkpoint `expected` (None: nothing saved yet) may go on from
    `resumed_step` (None: it found no checkpoint in `checkpoint_dir`); else why it must not, to be reported as
    `{FIELD}: {message}` (rlkube.core.errors.ConfigError)."""
    if not expected:
        return None
    want = step_of(expected)
    if resumed_step is not None and (want is None or resumed_step >= want):
        return None
    found = "no checkpoint" if resumed_step is None else f"only step {resumed_step}"
    step = f" step {want}" if want is not None else ""
    return (f"{_MARK} the checkpoint at {expected}{step} is gone ({checkpoint_dir} holds {found}): the checkpoint "
            f"volume was likely an emptyDir, lost with the trainer pod; the trainer will not silently start over. "
            f"Set {FIELD} to a PersistentVolumeClaim so a recreated trainer pod resumes")


def is_loss(message: str) -> bool:
    """Whether a role's termination message is `loss`'s (possibly prefixed, e.g. by the trainer launcher)."""
    return f"{FIELD}: {_MARK}" in (message or "")


def ephemeral_warning(spec: TrainingJobSpec) -> str | None:
    """The Warning a new job gets when its trainer may be recreated (runPolicy.backoffLimit > 0) onto an emptyDir
    checkpoint volume; None when the checkpoints are on a claim or no restart is allowed."""
    if spec.trainer.checkpoint.claim_name or spec.run_policy.backoff_limit == 0:
        return None
    # Fast-LLM's trainer is checked by its launcher (rlkube.core.launch.fast_llm) against the events it published.
    return (f"{FIELD} is unset: checkpoints go to an emptyDir, deleted with the trainer pod; a recreated trainer pod "
            f"(runPolicy.backoffLimit {spec.run_policy.backoff_limit}) starts over without its checkpoints, so it "
            f"fails the job instead of resuming. Set {FIELD} to a PersistentVolumeClaim to resume")
