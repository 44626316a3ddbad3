"""The spec diff behind SpecChangeIgnored, and the spec a running job acts on (live fields from the current one)."""

from __future__ import annotations

import copy

import pytest
from rlkube.controller.decisions import specdiff
from support.specs import DELETE, with_overrides

STARTED = {
    "algorithm": {"maxSteps": 40, "loss": "grpo"},
    "actor": {"replicas": 1, "resources": {"requests": {"cpu": "1"}}},
    "task": {"params": {}},
    "runPolicy": {"suspend": False, "backoffLimit": 3},
}


def edited(**changes) -> dict:
    """STARTED with `changes` (dotted paths; None removes the key)."""
    return with_overrides(copy.deepcopy(STARTED), {k: DELETE if v is None else v for k, v in changes.items()})


@pytest.mark.parametrize(
    ("changes", "paths"),
    [
        ({}, []),
        ({"runPolicy.suspend": True}, []),
        ({"algorithm.maxSteps": 80}, ["spec.algorithm.maxSteps"]),
        ({"algorithm.maxSteps": 80, "actor.replicas": 2}, ["spec.actor.replicas", "spec.algorithm.maxSteps"]),
        ({"actor.resources.requests.cpu": "2", "runPolicy.suspend": True}, ["spec.actor.resources.requests.cpu"]),
        ({"actor.resources.requests.memory": "1Gi"}, ["spec.actor.resources.requests.memory"]),  # added
        ({"runPolicy.backoffLimit": None}, ["spec.runPolicy.backoffLimit"]),  # removed
        ({"task.params": {"digits": 3}}, ["spec.task.params", "spec.task.params.digits"]),  # {} -> a mapping
        ({"image": "x"}, ["spec.image"]),  # a new top-level field
    ],
)
def test_changed_paths(changes, paths):
    assert specdiff.changed_paths(STARTED, edited(**changes)) == paths


def test_the_spec_acted_on_is_the_started_one_with_the_live_suspend():
    current = edited(**{"algorithm.maxSteps": 80, "runPolicy.suspend": True})
    acted = specdiff.with_live_fields(STARTED, current)
    assert acted["algorithm"]["maxSteps"] == 40 and acted["runPolicy"] == {"suspend": True, "backoffLimit": 3}
    assert STARTED["runPolicy"]["suspend"] is False  # the record is not modified
    assert "suspend" not in specdiff.with_live_fields(STARTED, edited(**{"runPolicy.suspend": None}))["runPolicy"]
