"""A minimal kopf operator for TrainingJobs, run by test_chart_apply.py under the chart's ServiceAccount.

It exercises what kopf itself does with the API (peering, CRD and namespace observation, its finalizer and
progress annotations, Events, status patches), so the test can show that the chart's RBAC is enough for the
framework. It is test infrastructure, not the product operator (that is `rlkube operator`).
"""

from __future__ import annotations

import kopf


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_) -> None:
    # Short timeouts so a watch that silently stalls shows up within the test, not after minutes.
    settings.watching.server_timeout = 30
    settings.watching.client_timeout = 40
    settings.posting.level = 0  # post every kopf Event, so events/create is exercised


@kopf.on.create("rlkube.io", "v1alpha1", "trainingjobs", id="probe-create")
def created(body: kopf.Body, name: str, patch: kopf.Patch, logger, **_) -> None:
    kopf.info(body, reason="Probe", message="seen by the RBAC probe")
    patch.status["phase"] = "Pending"
    logger.info("probe handled %s", name)


@kopf.on.delete("rlkube.io", "v1alpha1", "trainingjobs", id="probe-delete")
def deleted(name: str, logger, **_) -> None:
    logger.info("probe released %s", name)
