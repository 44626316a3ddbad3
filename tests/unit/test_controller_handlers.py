"""The kopf wiring: explicit handler ids, timeouts at start-up, and a diff-base equal to kopf's own."""

from __future__ import annotations

import copy

import kopf
from rlkube.controller import handlers


def _body() -> dict:
    return {
        "apiVersion": "rlkube.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "tj", "namespace": "ns", "uid": "u", "resourceVersion": "7", "generation": 2,
            "labels": {"team": "rl"},
            "annotations": {"note": "x", "rlkube.io/last-handled-configuration": "{}",
                            "kubectl.kubernetes.io/last-applied-configuration": "{}"},
            "ownerReferences": [{"kind": "Thing", "name": "o", "uid": "1", "apiVersion": "v1"}],
            "managedFields": [{"manager": "rlkube", "fieldsV1": {"f:status": {}}}],
            "finalizers": ["rlkube.io/teardown"],
        },
        "spec": {"algorithm": {"maxSteps": 3}, "runPolicy": {"suspend": False}},
        "status": {"phase": "Running", "conditions": [{"type": "TrainerReady", "status": "True"}] * 50},
    }


def test_lean_diffbase_builds_exactly_kopfs_essence():
    ours = handlers.LeanDiffBaseStorage(prefix="rlkube.io", key="last-handled-configuration")
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix="rlkube.io", key="last-handled-configuration")
    for body in (_body(), {**_body(), "status": {}}, {"metadata": {"name": "p"}, "spec": {}}):
        assert ours.build(body=kopf.Body(copy.deepcopy(body))) == kopfs.build(body=kopf.Body(copy.deepcopy(body)))
    essence = ours.build(body=kopf.Body(_body()))
    assert "status" not in essence and essence["metadata"] == {"labels": {"team": "rl"}, "annotations": {"note": "x"}}


def test_registry_has_explicit_handler_ids():
    registry = handlers.build_registry()
    ids = {h.id for h in registry._changing.get_all_handlers()} | {h.id for h in registry._spawning.get_all_handlers()}
    ids |= {h.id for h in registry._watching.get_all_handlers()} | {h.id for h in registry._indexing.get_all_handlers()}
    assert {"job-create", "job-resume", "job-update", "job-delete", "job-loop", "job-gone", "pod-changed",
            "pods_by_job", "configmaps_by_job", "secrets_by_job", "services_by_job", "configmaps-deleted",
            "secrets-deleted", "services-deleted"} <= ids


def test_startup_sets_watch_and_request_timeouts_and_the_finalizer():
    settings = kopf.OperatorSettings()
    handlers.apply_settings(settings)
    assert settings.watching.server_timeout == 120 and settings.watching.client_timeout == 150
    assert settings.networking.request_timeout == 60
    assert settings.persistence.finalizer == "rlkube.io/teardown"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, handlers.LeanDiffBaseStorage)
