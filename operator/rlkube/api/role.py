"""The roles of a TrainingJob and its trainer backends, as enums of the API.

A role names a spec section (spec.trainer, spec.actor, ...), a pod's `rlkube.io/role` label, its Service, its
condition and its teardown stage: one spelling here keeps them from drifting. The members are strings, so a label
read back from the API server compares equal to them.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """Every process kind of a job, in start order (docs/design.md §3)."""

    REDIS = "redis"
    TRAINER = "trainer"
    INFERENCE = "inference"
    SANDBOX = "sandbox"
    PREPROCESSOR = "preprocessor"
    ACTOR = "actor"


class Backend(StrEnum):
    """spec.trainer.backend: the trainer's training stack. `fast-llm` runs Fast-LLM's own trainer (docs/design.md
    §8), whose Redis keys, weight broadcast and pod differ from ours."""

    TORCH = "torch"
    MEGATRON = "megatron"
    FAST_LLM = "fast-llm"
