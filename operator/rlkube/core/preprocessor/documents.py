"""Rollout groups -> training documents, the preprocessor's pure part (rlkube.core.preprocessor.role runs it on
the job's streams; tests and tests/support/learning_run.py call it directly).

One document per usable sample in the Fast-LLM streaming format: tokens = prompt + completion,
`loss_masking_spans` = [[0, len(prompt)]] plus an episode's environment spans, sampling log-probs (0 on the
prompt), the policy version per token (in the trainer's units: steps for ours, documents seen for Fast-LLM's),
the group-relative advantage (advantages.py) and the reward. Malformed,
empty and too long samples are dropped with a log line; a group of one (unless cfg.drop_singletons is off: sft) and,
when asked, a group of equal rewards yield none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from rlkube.contract import protocol
from rlkube.core.preprocessor.advantages import group_advantages

log = logging.getLogger("rlkube.preprocessor")


@dataclass(frozen=True)
class DocumentConfig:
    estimator: str = "leave-one-out"
    normalize: bool = False
    max_length: int | None = None  # spec.model.maxSequenceLength: longer samples are dropped (and counted)
    drop_singletons: bool = True  # SFT keeps them: its loss does not use the advantage
    # Drop groups whose usable samples all have the same reward (spec.algorithm.filterZeroAdvantageGroups; the
    # role turns it off for sft). Off here so that the pure function keeps every group unless asked.
    filter_zero_advantage: bool = False
    # Non-zero for a Fast-LLM trainer (spec.algorithm.samplesPerStep): Fast-LLM reads a token's model_version in
    # documents-seen units (its staleness is documents_seen - model_version; tests/fixtures/
    # fast_llm_config_fields.json, `document`), so version v is written as the `documents_seen` of the
    # weights_ready that announced it, or v x samplesPerStep when none was seen (rlkube.core.actor.lag's rule).
    # 0: the version (a step), which our trainers read.
    documents_per_version: int = 0


EQUAL_REWARDS = 1e-6  # rewards closer than this count as equal (PipelineRL's epsilon, pipelinerl/preprocess.py:316)


def equal_rewards(samples: list[protocol.Sample]) -> bool:
    """Whether a group's rewards are all equal: every group-relative advantage is then zero."""
    rewards = [s.reward for s in samples]
    return max(rewards) - min(rewards) <= EQUAL_REWARDS


def group_to_documents(group: protocol.RolloutGroup, cfg: DocumentConfig,
                       announced: Mapping[int, int] | None = None) -> list[protocol.Document]:
    """Documents of one rollout group (pure). Samples that are malformed or too long are dropped with a log
    line; the advantages are computed over the samples that remain. `announced`: version -> documents_seen of
    the weights_ready events seen (read only when cfg.documents_per_version is set)."""
    return documents_of(group, cfg, announced)[0]


def version_units(versions: np.ndarray, cfg: DocumentConfig, announced: Mapping[int, int] | None = None) -> np.ndarray:
    """Per-token versions in the units the trainer reads (see DocumentConfig.documents_per_version)."""
    if not cfg.documents_per_version:
        return versions
    announced = announced or {}
    out = np.empty_like(versions)
    for v in np.unique(versions):
        out[versions == v] = announced.get(int(v), int(v) * cfg.documents_per_version)
    return out


def documents_of(group: protocol.RolloutGroup, cfg: DocumentConfig,
                 announced: Mapping[int, int] | None = None) -> tuple[list[protocol.Document], float | None]:
    """group_to_documents, and the reward its usable samples all had when the group was filtered for zero advantage
    (cfg.filter_zero_advantage; None when it was not filtered). The reward is a kept sample's: a dropped sample (too
    long, empty) may have had another."""
    docs, _, filtered = documents_with_sources(group, cfg, announced)
    return docs, filtered


def documents_with_sources(group: protocol.RolloutGroup, cfg: DocumentConfig,
                           announced: Mapping[int, int] | None = None
                           ) -> tuple[list[protocol.Document], list[int], float | None]:
    """documents_of, with the index in `group.samples` of each document's sample."""
    prompt = list(group.prompt_tokens)
    samples, sources = [], []
    for i, s in enumerate(group.samples):
        if not s.completion_tokens:
            log.warning("group %s: sample %d has an empty completion; dropped", group.group_id, i)
        elif len(s.logprobs) != len(s.completion_tokens):
            log.warning("group %s: sample %d has %d log-probs for %d tokens; dropped", group.group_id, i,
                        len(s.logprobs), len(s.completion_tokens))
        elif (problem := _episode_problem(s)) is not None:
            log.warning("group %s: sample %d %s; dropped", group.group_id, i, problem)
        elif cfg.max_length is not None and len(prompt) + len(s.completion_tokens) > cfg.max_length:
            log.warning("group %s: sample %d is %d tokens, over maxSequenceLength %d; dropped", group.group_id, i,
                        len(prompt) + len(s.completion_tokens), cfg.max_length)
        else:
            samples.append(s)
            sources.append(i)
    if not samples:
        return [], [], None
    if len(samples) == 1 and cfg.drop_singletons:
        log.info("group %s has a single usable sample (no baseline, advantage 0); dropped", group.group_id)
        return [], [], None
    if cfg.filter_zero_advantage and equal_rewards(samples):
        log.debug("group %s: all %d rewards equal %.4g (zero advantage); filtered", group.group_id, len(samples),
                  samples[0].reward)
        return [], [], samples[0].reward
    if len(samples) < group.expected_size:
        log.info("group %s is partial: %d of %d samples", group.group_id, len(samples), group.expected_size)
    advantages = group_advantages([s.reward for s in samples], cfg.estimator, cfg.normalize)  # type: ignore[arg-type]
    docs = []
    for s, adv in zip(samples, advantages, strict=True):
        tokens = np.asarray(prompt + list(s.completion_tokens), dtype=np.int64)
        old = np.zeros(len(tokens), dtype=np.float32)
        old[len(prompt):] = s.logprobs
        versions = np.full(len(tokens), group.model_version, dtype=np.int64)
        if s.versions is not None:
            versions[len(prompt):] = s.versions
        # An episode's environment turns are excluded from the loss like the prompt: the model did not sample them.
        spans = [(0, len(prompt))] + [(len(prompt) + b, len(prompt) + e) for b, e in s.env_spans or ()]
        docs.append(
            protocol.Document(
                tokens=tokens,
                loss_masking_spans=spans,
                advantage=float(adv),
                reward=float(s.reward),
                reward_error=bool(s.reward_error),
                old_log_probabilities=old,
                model_version=version_units(versions, cfg, announced),
            )
        )
    return docs, sources, None


def _episode_problem(s: protocol.Sample) -> str | None:
    """What is wrong with an episode's spans or versions, if anything."""
    n = len(s.completion_tokens)
    if s.versions is not None and len(s.versions) != n:
        return f"has {len(s.versions)} versions for {n} tokens"
    for b, e in s.env_spans or ():
        if not 0 <= b <= e <= n:
            return f"has an environment span {(b, e)} outside its {n} tokens"
    return None


def too_long(group: protocol.RolloutGroup, cfg: DocumentConfig) -> int:
    """Samples of `group` that group_to_documents drops for exceeding cfg.max_length."""
    if cfg.max_length is None:
        return 0
    prompt = len(group.prompt_tokens)
    return sum(1 for s in group.samples if prompt + len(s.completion_tokens) > cfg.max_length)
