"""When filtering zero-advantage groups starves the trainer, the job fails saying so instead of spinning.

Why: with spec.algorithm.filterZeroAdvantageGroups on, a group whose rewards are all equal becomes no document and
the actors sample a replacement (docs/design.md §7). A policy that has collapsed (it answers every prompt the same
way, right or wrong) or a task that is far too hard or too easy then yields nothing but filtered groups: the
actors sample at full speed forever, the trainer waits for a step that never fills, and the job's status says only
that it runs. verl's DAPO recipe bounds the same loop (`max_num_gen_batches`, "Generated too many. Please check if
your data are too difficult"); we bound the groups a preprocessor replica filters in a row, without one group that
becomes documents in between. Past the bound the preprocessor exits runtime.EXIT_CONFIG with `stall`'s message,
and the config_error policy fails the job at once with reason ZeroAdvantageStall (a restart would find the same
policy and the same data).

The default bound is generous on purpose: early in training a sparse reward makes long runs of filtered groups
normal (a 0.5% hit rate with groups of 16 gives a useful group 1 time in 13; 200 filtered in a row then has a
chance of about 1e-7). Each replica counts its own groups, so with N replicas up to N times the bound is sampled.

Pure and written once: the preprocessor, the operator and `rlkube local` use these functions.
"""

from __future__ import annotations

from rlkube.api.spec import TrainingJobSpec

FIELD = "spec.algorithm.maxConsecutiveFilteredGroups"
"""The bound a user raises (or sets to 0 for none); turning spec.algorithm.filterZeroAdvantageGroups off also
ends it."""
_MARK = "zero-advantage stall:"
STEPS_OF_GROUPS = 10
"""The default bound in trainer steps' worth of groups (verl's DAPO recipe defaults max_num_gen_batches to 10)."""
FLOOR = 200
"""The default bound never goes below this many groups (see the module's note on sparse rewards)."""


def filters(spec: TrainingJobSpec) -> bool:
    """Whether the preprocessor drops groups of equal rewards: the switch, never for loss sft (its reference
    completions all score the same by construction)."""
    return spec.algorithm.filter_zero_advantage_groups and spec.algorithm.loss != "sft"


def limit(spec: TrainingJobSpec) -> int | None:
    """How many groups in a row a preprocessor replica may filter before the job fails; None for no bound (the
    filter is off, or the user set 0)."""
    if not filters(spec):
        return None
    algo = spec.algorithm
    if algo.max_consecutive_filtered_groups is not None:
        return algo.max_consecutive_filtered_groups or None
    groups_per_step = -(-algo.samples_per_step // algo.group_size)
    return max(STEPS_OF_GROUPS * groups_per_step, FLOOR)


def stall(filtered_in_a_row: int, bound: int, last_reward: float, documents: int) -> str:
    """Why the job fails, to be reported as `{FIELD}: {message}` (rlkube.core.errors.ConfigError)."""
    return (f"{_MARK} {filtered_in_a_row} rollout groups in a row had all-equal rewards (the last ones all "
            f"{last_reward:.4g}) and were filtered as zero-advantage, the bound being {bound}; the trainer gets no "
            f"documents ({documents} written by this preprocessor so far). The policy has likely collapsed to one "
            f"answer per prompt, or the task is too hard or too easy for it. Raise {FIELD} (0: no bound), or set "
            f"spec.algorithm.filterZeroAdvantageGroups to false to train on such groups (with advantage 0)")


def is_stall(message: str) -> bool:
    """Whether a role's termination message is `stall`'s."""
    return f"{FIELD}: {_MARK}" in (message or "")
