"""The operator's own Kubernetes API calls: JSON over one pooled aiohttp session, with kopf's credentials.

Why not kubernetes_asyncio: the operator's calls are few and plain JSON (kube.py, election.py), but importing
kubernetes_asyncio loads ~700 generated modules, and when it (or the sync `kubernetes`) is installed kopf imports
it too, only to recognise its model objects (kopf/_cogs/helpers/thirdparty.py). Together that is ~56 MB of RSS
(kopf imports at 99 MB with them, 43 MB without), a fifth of what 1000 jobs may cost the operator
(`rlkube bench operator`). The credentials are kopf's readers (kopf.login_with_service_account, else
kopf.login_with_kubeconfig), so the operator's calls and kopf's watches authenticate alike.

What this gives up, against kubernetes_asyncio's config: a kubeconfig whose user runs an exec plugin or an
auth-provider other than a stored token. In a pod the service account is used, which needs neither.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp
import kopf
import orjson

log = logging.getLogger(__name__)

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
# A request that the API server has not answered in this long is retried by the caller's next pass.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=60)


class ApiError(Exception):
    """An error status from the API server; `body` is its Status object's JSON, which names the field."""

    def __init__(self, status: int, reason: str, body: bytes = b""):
        super().__init__(f"({status}) {reason}")
        self.status, self.reason, self.body = status, reason, body


def load_credentials() -> kopf.ConnectionInfo:
    """The service account in a pod, else the kubeconfig (KUBECONFIG or ~/.kube/config), as kopf reads them."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings)
    if info is not None:
        return dataclasses.replace(info, server=in_cluster_server(os.environ) or info.server)
    info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account token and no kubeconfig (KUBECONFIG or ~/.kube/config)")
    return info


def in_cluster_server(env: Mapping[str, str]) -> str | None:
    """The API server as the kubelet tells a pod (client-go's InClusterConfig): it needs no cluster DNS, which
    kopf's reader (https://kubernetes.default.svc) does, and a hostNetwork pod with dnsPolicy Default lacks."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return None
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def bounded_session(info: kopf.ConnectionInfo, limit: int, **kwargs: Any) -> aiohttp.ClientSession:
    """An aiohttp session to the API server of `info` (its CA and client certificate, its proxy) with at most
    `limit` connections, trust_env off: the operator talks to the API server directly (with it on, aiohttp looks up
    proxies and reads ~/.netrc in a worker thread on every request). Used for kopf's session and for ours."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()), proxy=info.proxy_url, **kwargs
    )


class ApiClient:
    """At most `pool_size` connections to the API server; a 401 re-reads the credentials once (a service account
    token is rotated on disk while the operator runs)."""

    def __init__(self, pool_size: int = 32, credentials: Callable[[], kopf.ConnectionInfo] = load_credentials):
        self._credentials = credentials
        info = credentials()
        self._headers = info.as_http_headers()
        self.server = info.server.rstrip("/")
        self.session = bounded_session(info, pool_size, timeout=REQUEST_TIMEOUT)

    async def close(self) -> None:
        await self.session.close()

    async def request(self, method: str, path: str, body: Any = None, *, content_type: str = JSON) -> dict:
        """The response's JSON; ApiError for an error status."""
        data = orjson.dumps(body) if body is not None else None
        status, reason, raw = await self._send(method, path, data, content_type)
        if status == 401:
            self._reload()
            status, reason, raw = await self._send(method, path, data, content_type)
        if not 200 <= status <= 299:
            raise ApiError(status, reason, raw)
        return orjson.loads(raw) if raw else {}

    async def _send(self, method: str, path: str, data: bytes | None, content_type: str) -> tuple[int, str, bytes]:
        headers = {**self._headers, "Accept": JSON}
        if data is not None:
            headers["Content-Type"] = content_type
        async with self.session.request(method, self.server + path, data=data, headers=headers) as response:
            return response.status, response.reason or "", await response.read()

    async def watch(self, path: str, params: dict[str, str], timeout: float) -> AsyncIterator[dict]:
        """The events of one watch request (one JSON object a line) until the server ends it."""
        query = {**params, "watch": "true"}
        async with self.session.get(self.server + path, params=query, headers=self._headers,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=30,
                                                                  sock_read=timeout)) as response:
            if response.status == 401:
                self._reload()
            if not 200 <= response.status <= 299:
                raise ApiError(response.status, response.reason or "", await response.read())
            async for line in response.content:
                if line.strip():
                    yield orjson.loads(line)

    def _reload(self) -> None:
        self._headers = self._credentials().as_http_headers()
        log.info("the API server answered 401: credentials read again")
