"""The trainer's metrics record: what core/trainer/reporting.py fills, the flat payload it sends, and what
lifecycle/progress.py reads back from it and from foreign or garbled payloads."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from rlkube.contract import protocol
from rlkube.contract.step_metrics import StepMetrics
from rlkube.core.trainer.reporting import OFF_POLICY, StepReports
from rlkube.lifecycle import progress

DOC_STATS = {"reward_mean": 0.25, "lag_max": 2, "stale_documents": 1, "tokens": 640, "reward_errors": 0}
LOSS_STATS = {"loss": 0.5, "loss_tokens": 320.0, "ratio_mean": 1.0, "clipped_fraction": 0.1, "kl": 0.01,
              "entropy": 2.5, "grad_norm": 0.7, "lr": 1e-5, "logprob_diff_abs": 0.02, "ref_kl": 0.003}


def trainer_metrics(**loss_stats) -> StepMetrics:
    """The record the trainer's reporting builds, over a stand-in for the TrainerRole attributes it reads."""
    role = SimpleNamespace(trainer=SimpleNamespace(step=7, version=7, documents_seen=112), skipped=3,
                           _filtered=lambda: {"filtered_groups": 2, "filtered_samples": 8},
                           _episodes=lambda: {"episode_turns": 30, "turns_per_episode": 2.5})
    return StepReports._metrics(role, DOC_STATS, {**LOSS_STATS, **loss_stats}, wait_s=1.0, busy_s=2.0, publish_s=1.0)


def test_the_trainer_fills_every_typed_field_and_sends_it_flat():
    m = trainer_metrics()
    empty = [f.name for f in dataclasses.fields(m) if getattr(m, f.name) is None]
    assert empty == []
    payload = m.payload()
    assert payload["tokens_per_s"] == 640 / 4.0 and payload["learning_rate"] == 1e-5 and payload["step"] == 7
    assert list(payload)[:3] == ["step", "version", "loss"]
    assert {"logprob_diff_abs", "ref_kl", "filtered_groups", "episode_turns", "turns_per_episode"} <= set(payload)
    assert "is_ratio_mean" not in payload  # not measured this step: not reported
    assert set(OFF_POLICY) >= {"logprob_diff_abs", "ref_kl"}
    assert "extra" not in payload


def sent(m: StepMetrics) -> protocol.TrainerEvent:
    """The metrics event as the events stream carries it (the trainer's encode, every reader's decode)."""
    return protocol.decode_event("1-0", protocol.encode_event(protocol.METRICS, **m.payload()))


def test_what_the_trainer_sends_is_read_back_whole():
    m = trainer_metrics()
    assert StepMetrics.read(sent(m).payload) == m


def test_a_backend_without_entropy_sends_null_and_the_reader_keeps_the_rest():
    stats = dict(LOSS_STATS)
    del stats["entropy"]
    role = SimpleNamespace(trainer=SimpleNamespace(step=1, version=1, documents_seen=16), skipped=0,
                           _filtered=dict, _episodes=dict)
    m = StepReports._metrics(role, DOC_STATS, stats, 0.0, 1.0, 0.0)
    assert m.payload()["entropy"] is None
    back = StepMetrics.read(m.payload())
    assert back.entropy is None and back.loss == 0.5


def test_the_reader_takes_only_well_formed_fields_and_an_older_trainers_lag():
    m = StepMetrics.read({"type": "metrics", "step": "seven", "lag": 3, "reward_mean": float("nan"),
                          "tokens_per_s": True, "documents_seen": 1e300, "loss": 0.4, "kl": 10**400,
                          "my_counter": 5, "note": "x", "huge": 10**400})
    assert (m.step, m.lag_max, m.reward_mean, m.tokens_per_s, m.documents_seen, m.loss, m.kl) == \
        (None, 3, None, None, None, 0.4, None)
    assert m.extra == {"my_counter": 5}
    assert StepMetrics.read({"lag_max": 1, "lag": 9}).lag_max == 1


def test_an_extra_counter_may_not_shadow_a_typed_field():
    with pytest.raises(ValueError, match="lag_max"):
        StepMetrics(step=1, extra={"lag_max": 4}).payload()


def test_the_job_progress_is_read_through_the_record():
    ev = sent(trainer_metrics())
    facts = progress.read(ev)
    assert (facts.step, facts.lag, facts.reward_mean, facts.tokens_per_s) == (7, 2, 0.25, 160.0)
    assert facts.metrics == ev.payload
