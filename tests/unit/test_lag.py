"""The lag bound's arithmetic (pure): which sample numbers may be sampled at which trainer position."""

from __future__ import annotations

import math

import pytest
from rlkube.core.lag import documents_seen_of, sample_budget


@pytest.mark.parametrize("max_lag", [0, 1, 2, 5])
@pytest.mark.parametrize("per_step", [1, 4, 32])
def test_budget_is_exactly_the_samples_whose_lag_stays_within_max_lag(max_lag, per_step):
    # Sample r (1-based) is consumed by the step that starts from version ceil(r/S) - 1. Sampled when the
    # trainer has consumed D = v*S documents (version v), its lag is ceil(r/S) - 1 - v.
    for version in range(4):
        seen = version * per_step
        budget = sample_budget(seen, max_lag, per_step)
        for r in range(seen + 1, seen + (max_lag + 3) * per_step):
            lag = math.ceil(r / per_step) - 1 - version
            assert (r <= budget) == (lag <= max_lag), (r, version)


def test_documents_seen_of_events():
    assert documents_seen_of({"type": "weights_ready", "step": 3, "documents_seen": 90, "version": 3}, 32) == (3, 90)
    # Fast-LLM's shape: no version field, the step is the version
    assert documents_seen_of({"type": "weights_ready", "step": 2, "documents_seen": 64}, 32) == (2, 64)
    # documents_seen missing or 0: version x samplesPerStep
    assert documents_seen_of({"type": "weights_ready", "step": 2, "version": 2}, 32) == (2, 64)
    assert documents_seen_of({"type": "weights_ready", "step": 2, "version": 2, "documents_seen": 0}, 8) == (2, 16)
    assert documents_seen_of({"type": "weights_ready", "version": True}, 8) == (0, 0)
