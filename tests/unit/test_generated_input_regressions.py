"""What the generated-input tests (tests/integration/test_generated_*.py) found, pinned as plain rows: trainer
events and specs at the edges of what JSON and the CRD schema let through must neither crash a reconcile pass
nor end up in a status the API server cannot store."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from rlkube.api.spec import MAX_SECONDS, RunPolicy
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests.names import job_name_error
from rlkube.controller.decisions.times import stream_id_time
from rlkube.contract import protocol
from rlkube.lifecycle import progress


def event(type_: str, **payload) -> protocol.TrainerEvent:
    return protocol.TrainerEvent("1-0", type_, {"type": type_, **payload})


@pytest.mark.parametrize("step, expected", [(40, 40), (40.0, 40), (1e308, None), (2**63, None), (2**63 - 1, 2**63 - 1),
                                            (-(2**63) - 1, None), (True, None), ("40", None)])
def test_an_event_step_is_an_int64_or_nothing(step, expected):
    assert event(protocol.WEIGHTS_READY, step=step).step == expected
    assert progress.read(event(protocol.WEIGHTS_READY, step=1, version=step)).weights_version == (
        expected if expected is not None else 1)


def test_a_checkpoint_path_longer_than_path_max_is_no_checkpoint():
    long = "/" + "x" * progress.MAX_PATH
    assert progress.read(event(protocol.CHECKPOINT_SAVED, step=3, path=long)).checkpoint is None
    assert progress.read(event(protocol.TRAINING_FINISHED, step=3, checkpoint=long)).checkpoint is None
    assert progress.read(event(protocol.CHECKPOINT_SAVED, step=3, path="/c/3")).checkpoint == (3, "/c/3")


@pytest.mark.parametrize("payload, interrupted", [({"step": 40}, False), ({}, False), ({"step": "forty"}, True),
                                                  ({"step": None}, True), ({"step": 1e300}, True)])
def test_a_training_finished_with_a_garbled_step_is_not_a_full_finish(payload, interrupted):
    facts = progress.read(event(protocol.TRAINING_FINISHED, **payload))
    assert facts.finished and facts.interrupted is interrupted


def test_a_stream_id_beyond_year_9999_reads_as_the_latest_time():
    assert stream_id_time(f"{2**62}-0") == datetime.max.replace(tzinfo=UTC)
    assert stream_id_time("1000-0") == datetime.fromtimestamp(1, UTC)


@pytest.mark.parametrize("field", ["completionTimeoutSeconds", "eventTimeoutSeconds", "ttlSecondsAfterFinished"])
def test_durations_are_bounded_so_now_plus_duration_is_a_datetime(field):
    RunPolicy.model_validate({field: MAX_SECONDS})
    with pytest.raises(ValidationError):
        RunPolicy.model_validate({field: MAX_SECONDS + 1})


@pytest.mark.parametrize("name, says", [("tiny-cpu", None), ("l" * 51, None), ("l" * 52, "too long"),
                                        ("1job", "DNS-1035"), ("a.b", "DNS-1035"), ("Job", "DNS-1035")])
def test_a_job_name_its_children_cannot_carry_is_refused_naming_metadata_name(name, says):
    spec = parse_spec({"model": {"path": "builtin://tiny-llama"}, "algorithm": {"maxSteps": 3},
                       "inference": {"engine": "native"}})
    error = job_name_error(name, spec)
    assert (error is None) if says is None else (error.startswith("metadata.name: ") and says in error)


@pytest.mark.parametrize("patch, field", [
    ({"image": " ghcr.io/x:1"}, "spec.image"),
    ({"actor": {"image": "ghcr.io/x:1\n"}}, "spec.actor.image"),
    ({"trainer": {"checkpoint": {"path": "/etc/rlkube/"}}}, "spec.trainer.checkpoint.path"),
    ({"actor": {"resources": {"limits": {"hugepages-2Mi": "4Mi"}}}}, "spec.actor.resources"),
    ({"trainer": {"resources": {"requests": {"example.com/dev": 1}}}}, "spec.trainer.resources.requests.example.com/dev"),
    ({"trainer": {"resources": {"limits": {"example.com/dev": "500m"}}}}, "spec.trainer.resources.limits.example.com/dev"),
    ({"trainer": {"checkpoint": {"path": "checkpoints"}}}, "spec.trainer.checkpoint.path"),
    ({"redis": {"mode": "external", "url": "redis://r:6379/0", "passwordSecret": {"name": "Bad_Name"}}},
     "spec.redis.passwordSecret.name"),
    ({"redis": {"mode": "external", "url": "redis://r:6379/0", "passwordSecret": {"name": "pw", "key": "a/b"}}},
     "spec.redis.passwordSecret.key"),
])
def test_values_a_pod_would_refuse_are_refused_up_front_naming_the_field(patch, field):
    from rlkube.lifecycle.validation import SpecError

    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"path": "builtin://tiny-llama"}, "algorithm": {"maxSteps": 3},
                    "inference": {"engine": "native"}, **patch})
    assert [e.field for e in err.value.errors] == [field]
