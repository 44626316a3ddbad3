"""The few Kubernetes API calls the reconcile loop makes (apiclient.py), each made idempotent.

Create treats 409 AlreadyExists as present; delete treats 404 as gone and carries the pod's UID as a
precondition, so deleting a failed pod can never hit the replacement that took its name (409 = already
replaced). Nothing here decides anything.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from rlkube.api.spec import GROUP, PLURAL, VERSION
from rlkube.controller.decisions import kueue
from rlkube.controller.reconcile import metrics
from rlkube.controller.reconcile.apiclient import MERGE_PATCH, ApiClient, ApiError

log = logging.getLogger(__name__)

# Where each child kind lives: (API path prefix, plural).
PATHS = {
    "Pod": ("/api/v1", "pods"),
    "Service": ("/api/v1", "services"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
}


def collection(namespace: str, kind: str) -> str:
    prefix, plural = PATHS[kind]
    return f"{prefix}/namespaces/{namespace}/{plural}"


def custom_path(group: str, version: str, namespace: str, plural: str, name: str = "") -> str:
    path = f"/apis/{group}/{version}/namespaces/{namespace}/{plural}"
    return f"{path}/{name}" if name else path


class Kube:
    def __init__(self, api: ApiClient):
        self.api = api

    async def create(self, namespace: str, manifest: dict[str, Any]) -> dict | None:
        """Create a child; returns the created object, or None when it already existed."""
        kind = manifest["kind"]
        if kind == "Workload":
            group, version = manifest["apiVersion"].split("/")
            path = custom_path(group, version, namespace, kueue.WORKLOADS)
        else:
            path = collection(namespace, kind)
        try:
            return await self.api.request("POST", path, manifest)
        except ApiError as exc:
            if exc.status == 409:
                return None
            metrics.API_ERRORS.labels("create", kind).inc()
            raise

    async def patch_workload_status(
        self, namespace: str, name: str, resource_version: str, status: dict[str, Any]
    ) -> None:
        """Merge-patch a Kueue Workload's status; 409 (Kueue wrote first) and 404 are left to the next pass."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            await self.api.request("PATCH", custom_path(kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name)
                                   + "/status", body, content_type=MERGE_PATCH)
        except ApiError as exc:
            if exc.status in (404, 409):
                log.info("Workload %s/%s status not patched (%s): the next pass decides again", namespace, name,
                         exc.status)
                return
            metrics.API_ERRORS.labels("patch", "Workload").inc()
            raise

    async def read_resource_flavor(self, name: str) -> dict:
        return await self.api.request("GET", f"/apis/{kueue.GROUP}/{kueue.VERSION}/{kueue.RESOURCE_FLAVORS}/{name}")

    async def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int) -> bool:
        """Delete (or force-delete with grace 0) one pod; False when it was already gone or replaced."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": grace_seconds}
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            await self.api.request("DELETE", f"{collection(namespace, 'Pod')}/{name}", body)
            return True
        except ApiError as exc:
            if exc.status in (404, 409):
                return False
            metrics.API_ERRORS.labels("delete", "Pod").inc()
            raise

    async def delete_object(self, namespace: str, kind: str, name: str) -> None:
        try:
            await self.api.request("DELETE", f"{collection(namespace, kind)}/{name}")
        except ApiError as exc:
            if exc.status != 404:
                metrics.API_ERRORS.labels("delete", kind).inc()
                raise

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        try:
            secret = await self.api.request("GET", f"{collection(namespace, 'Secret')}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        value = (secret.get("data") or {}).get(key)
        return base64.b64decode(value).decode() if value is not None else None

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            await self.api.request("PATCH", custom_path(GROUP, VERSION, namespace, PLURAL, name) + "/status",
                                   {"status": status}, content_type=MERGE_PATCH)
        except ApiError as exc:
            if exc.status == 404:
                return  # the job is gone (its finalizer was removed); nothing left to record
            metrics.API_ERRORS.labels("patch", "TrainingJob").inc()
            raise

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self.api.request("DELETE", custom_path(GROUP, VERSION, namespace, PLURAL, name))
        except ApiError as exc:
            if exc.status != 404:
                raise
