"""The few Kubernetes API calls the reconcile loop makes (kubernetes_asyncio), each made idempotent.

Create treats 409 AlreadyExists as present; delete treats 404 as gone and carries the pod's UID as a
precondition, so deleting a failed pod can never hit the replacement that took its name (409 = already
replaced). Nothing here decides anything.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import orjson
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from rlkube.api.spec import GROUP, PLURAL, VERSION
from rlkube.controller import kueue, metrics

log = logging.getLogger(__name__)


async def api_client(kubeconfig: str | None = None, pool_size: int = 32) -> client.ApiClient:
    """In-cluster service account when there is one, else the kubeconfig (KUBECONFIG or ~/.kube/config; an explicit
    `kubeconfig` is always used); at most `pool_size` connections to the API server."""
    cfg = client.Configuration()
    try:
        if kubeconfig:
            raise config.ConfigException("explicit kubeconfig")
        config.load_incluster_config(client_configuration=cfg)
    except config.ConfigException:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    api = client.ApiClient(configuration=cfg)
    # kubernetes_asyncio builds its aiohttp session with trust_env=True, so every request looks up proxies
    # in the environment and reads ~/.netrc in a worker thread (profiled at 200 jobs: a thread hop and a file
    # read per API call). The operator talks to the API server directly, as kopf's own session does.
    api.rest_client.pool_manager._trust_env = False
    return api


async def checked(response: Any) -> Any:
    """kubernetes_asyncio raises for an error status only when it preloads the body: with
    `_preload_content=False` (used here for speed) a 404, 409 or 422 comes back as a plain response."""
    if 200 <= response.status <= 299:
        return response
    body = await response.read()
    response.release()
    exc = ApiException(status=response.status, reason=response.reason)
    exc.body = body.decode(errors="replace")
    raise exc


class Kube:
    def __init__(self, api: client.ApiClient):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.networking = client.NetworkingV1Api(api)

    async def create(self, namespace: str, manifest: dict[str, Any]) -> dict | None:
        """Create a child; returns the created object, or None when it already existed."""
        kind = manifest["kind"]
        if kind == "Workload":
            return await self._create_workload(namespace, manifest)
        create = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
            "ConfigMap": self.core.create_namespaced_config_map,
            "NetworkPolicy": self.networking.create_namespaced_network_policy,
        }[kind]
        try:
            # Raw JSON: deserialising into the generated models and back costs more than the request.
            response = await checked(await create(namespace, manifest, _preload_content=False))
            return orjson.loads(await response.read())
        except ApiException as exc:
            if exc.status == 409:
                return None
            metrics.API_ERRORS.labels("create", kind).inc()
            raise

    async def _create_workload(self, namespace: str, manifest: dict[str, Any]) -> dict | None:
        group, version = manifest["apiVersion"].split("/")
        try:
            return await self.custom.create_namespaced_custom_object(group, version, namespace, "workloads", manifest)
        except ApiException as exc:
            if exc.status == 409:
                return None
            metrics.API_ERRORS.labels("create", "Workload").inc()
            raise

    async def patch_workload_status(
        self, namespace: str, name: str, resource_version: str, status: dict[str, Any]
    ) -> None:
        """Merge-patch a Kueue Workload's status; 409 (Kueue wrote first) and 404 are left to the next pass."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        try:
            response = await checked(await self.custom.patch_namespaced_custom_object_status(
                kueue.GROUP, kueue.VERSION, namespace, kueue.WORKLOADS, name, body,
                _content_type="application/merge-patch+json", _preload_content=False,
            ))
            response.release()
        except ApiException as exc:
            if exc.status in (404, 409):
                log.info("Workload %s/%s status not patched (%s): the next pass decides again", namespace, name,
                         exc.status)
                return
            metrics.API_ERRORS.labels("patch", "Workload").inc()
            raise

    async def read_resource_flavor(self, name: str) -> dict:
        return await self.custom.get_cluster_custom_object(kueue.GROUP, kueue.VERSION, kueue.RESOURCE_FLAVORS, name)

    async def delete_pod(self, namespace: str, name: str, uid: str | None, grace_seconds: int) -> bool:
        """Delete (or force-delete with grace 0) one pod; False when it was already gone or replaced."""
        body = client.V1DeleteOptions(
            grace_period_seconds=grace_seconds,
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
        )
        try:
            response = await checked(
                await self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False)
            )
            response.release()
            return True
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            metrics.API_ERRORS.labels("delete", "Pod").inc()
            raise

    async def delete_object(self, namespace: str, kind: str, name: str) -> None:
        delete = {
            "Service": self.core.delete_namespaced_service,
            "Secret": self.core.delete_namespaced_secret,
            "ConfigMap": self.core.delete_namespaced_config_map,
            "NetworkPolicy": self.networking.delete_namespaced_network_policy,
        }[kind]
        try:
            response = await checked(await delete(name, namespace, _preload_content=False))
            response.release()
        except ApiException as exc:
            if exc.status != 404:
                metrics.API_ERRORS.labels("delete", kind).inc()
                raise

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        try:
            secret = await self.core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        value = (secret.data or {}).get(key)
        return base64.b64decode(value).decode() if value is not None else None

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            response = await checked(await self.custom.patch_namespaced_custom_object_status(
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": status},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            ))
            response.release()
        except ApiException as exc:
            if exc.status == 404:
                return  # the job is gone (its finalizer was removed); nothing left to record
            metrics.API_ERRORS.labels("patch", "TrainingJob").inc()
            raise

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
