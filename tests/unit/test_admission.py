"""The admission webhook's review (rlkube.controller.process.admission): the operator's own rules at apply time, CREATE
only, the AdmissionReview answer the API server expects. Served for real in
tests/integration/apiserver/test_chart_apply.py."""

from __future__ import annotations

from support import specs
from rlkube.controller.process import admission


def _review(obj: dict, operation: str = "CREATE", uid: str = "u-1") -> dict:
    answer = admission.review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "request": {"uid": uid, "operation": operation, "namespace": "ns", "object": obj}})
    assert (answer["apiVersion"], answer["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    assert answer["response"]["uid"] == uid
    return answer["response"]


def test_a_valid_job_is_allowed():
    assert _review(specs.document()) == {"uid": "u-1", "allowed": True}


def test_a_job_the_operator_would_fail_is_refused_naming_every_field():
    bad = specs.document(**{"spec.actor.image": "my image:latest", "spec.redis.mode": "external"})
    response = _review(bad)
    assert response["allowed"] is False
    status = response["status"]
    assert (status["code"], status["reason"]) == (422, "Invalid")
    assert status["message"].startswith("TrainingJob tiny-cpu: ")
    assert "spec.actor.image: 'my image:latest' is not an image reference" in status["message"]
    assert "spec.redis.url: required when spec.redis.mode is external" in status["message"]
    schema = _review(specs.document(**{"spec.algorithm.maxSteps": 0}))["status"]["message"]
    assert "spec.algorithm.maxSteps: Input should be greater than or equal to 1" in schema


def test_a_name_too_long_for_the_children_is_refused():
    status = _review(specs.document(**{"metadata.name": "j" * 60}))["status"]
    assert "metadata.name: '" + "j" * 60 + "' is too long" in status["message"]


def test_updates_and_other_objects_pass():
    """An UPDATE is never refused (the operator's finalizer patches; an older invalid job must stay deletable),
    nor is anything that is not a TrainingJob."""
    bad = specs.document(**{"spec.algorithm.maxSteps": 0})
    assert _review(bad, operation="UPDATE")["allowed"] is True
    assert _review({**bad, "kind": "ConfigMap", "apiVersion": "v1"})["allowed"] is True
