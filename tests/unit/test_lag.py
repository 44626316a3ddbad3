"""The lag bound's arithmetic (pure): which sample numbers may be sampled at which trainer position."""

from __future__ import annotations

import json
import math

import pytest
from rlkube.contract import protocol
from rlkube.core.actor.lag import documents_seen_of, sample_budget


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


def _fast_llm_weights_ready(step: int, documents_seen: int | None) -> protocol.TrainerEvent:
    """A weights_ready entry exactly as Fast-LLM XADDs it (fast_llm/engine/training/streaming.py:99-106 at the
    commit tests/fixtures/fast_llm_config_fields.json records: field `event`, JSON with type, step and
    documents_seen); documents_seen None stands for a trainer that does not report it."""
    payload = {"type": "weights_ready", "step": step}
    if documents_seen is not None:
        payload["documents_seen"] = documents_seen
    return protocol.decode_event(f"{step + 1}-0", {b"event": json.dumps(payload).encode()})


def _run(per_step: int, overshoot: int, max_lag: int, steps: int, reports_documents_seen: bool):
    """Trainer and actors in lockstep. The trainer's step k consumes per_step + overshoot documents (Fast-LLM
    fills its last micro-batch past docs_per_step) and announces version k+1; between announcements the actors
    write every sample the newest announcement admits (as rlkube.core.actor does: budget of the newest
    weights_ready, decoded by documents_seen_of). Returns the rollouts each step found waiting (None where the
    trainer starved) and the largest lag of any consumed sample."""
    written = consumed = 0
    sampled_with: list[int] = []  # version of each written sample, in stream order
    waiting, worst_lag = [], 0
    event = _fast_llm_weights_ready(0, 0 if reports_documents_seen else None)
    for step in range(steps):
        version, seen = documents_seen_of(event.payload, per_step)
        budget = sample_budget(seen, max_lag, per_step)
        sampled_with += [version] * max(0, budget - written)
        written = max(written, budget)
        need = per_step + overshoot
        waiting.append(written - consumed if written - consumed >= need else None)
        if written - consumed < need:
            break
        worst_lag = max(worst_lag, *(step - v for v in sampled_with[consumed:consumed + need]))
        consumed += need
        event = _fast_llm_weights_ready(step + 1, consumed if reports_documents_seen else None)
    return waiting, worst_lag


@pytest.mark.parametrize(("per_step", "overshoot", "max_lag"), [(8, 1, 1), (32, 5, 2), (4, 3, 1)])
def test_fast_llm_overshoot_keeps_the_actors_within_the_lag_bound(per_step, overshoot, max_lag):
    # (An overshoot above maxLag x samplesPerStep cannot be admitted by any rule that keeps the bound.)
    steps = 50
    waiting, worst_lag = _run(per_step, overshoot, max_lag, steps, reports_documents_seen=True)
    # Every step finds its documents (samplesPerStep + overshoot) waiting: the actors never fall behind...
    assert len(waiting) == steps and None not in waiting
    assert min(waiting) >= per_step + overshoot
    # ...and no consumed sample is older than maxLag versions.
    assert worst_lag <= max_lag
    # The old rule (credit = step x samplesPerStep) loses `overshoot` documents of credit per step: the
    # trainer starves within (maxLag + 1) x samplesPerStep / overshoot steps, and from then on only the actors'
    # stall release (one group per stall period, rlkube.core.actor.lag) would move it.
    old, _ = _run(per_step, overshoot, max_lag, steps, reports_documents_seen=False)
    assert old[-1] is None and len(old) <= (max_lag + 1) * per_step // overshoot + 1
