"""apiclient.ApiClient against a real HTTP server (aiohttp's): what it sends, the errors it raises (their Status
body, which names the field), the retry with fresh credentials after a 401, and a watch read line by line; and
that the operator process never imports a Kubernetes client library (the reason apiclient exists)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import kopf
import orjson
import pytest
from aiohttp import web

from rlkube.controller.reconcile.apiclient import MERGE_PATCH, ApiClient, ApiError, in_cluster_server

ROOT = Path(__file__).resolve().parents[2]


@contextlib.asynccontextmanager
async def api_server(handler):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def credentials_from(server: str, tokens: list[str]):
    """Each call reads the next token, as a rotated service account token file would give."""
    calls = []

    def read() -> kopf.ConnectionInfo:
        calls.append(1)
        return kopf.ConnectionInfo(server=server, token=tokens[min(len(calls), len(tokens)) - 1])

    return read, calls


async def test_requests_send_json_with_the_content_type_and_token_and_return_the_json():
    seen = []

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.path_qs, request.headers.get("Content-Type"),
                     request.headers["Authorization"], await request.read()))
        return web.json_response({"kind": "Pod", "metadata": {"name": "p"}}, status=201)

    async with api_server(handler) as url:
        read, _ = credentials_from(url, ["t1"])
        api = ApiClient(pool_size=4, credentials=read)
        assert api.session.connector.limit == 4
        try:
            created = await api.request("POST", "/api/v1/namespaces/ns/pods", {"kind": "Pod"})
            await api.request("PATCH", "/apis/g/v1/namespaces/ns/x/n/status", {"status": {}},
                              content_type=MERGE_PATCH)
            await api.request("GET", "/api/v1/namespaces/ns/secrets/s")
        finally:
            await api.close()
    assert created == {"kind": "Pod", "metadata": {"name": "p"}}
    assert seen == [
        ("POST", "/api/v1/namespaces/ns/pods", "application/json", "Bearer t1", b'{"kind":"Pod"}'),
        ("PATCH", "/apis/g/v1/namespaces/ns/x/n/status", MERGE_PATCH, "Bearer t1", b'{"status":{}}'),
        ("GET", "/api/v1/namespaces/ns/secrets/s", None, "Bearer t1", b""),
    ]


async def test_an_error_status_raises_with_the_status_body_that_names_the_field():
    status = {"kind": "Status", "status": "Failure", "reason": "Invalid", "code": 422,
              "message": 'Pod "p" is invalid: spec.containers[0].image: Required value'}

    async def handler(request: web.Request) -> web.Response:
        return web.json_response(status, status=422)

    async with api_server(handler) as url:
        api = ApiClient(credentials=credentials_from(url, ["t"])[0])
        try:
            with pytest.raises(ApiError) as caught:
                await api.request("POST", "/api/v1/namespaces/ns/pods", {})
        finally:
            await api.close()
    assert caught.value.status == 422 and caught.value.reason == "Unprocessable Entity"
    assert "spec.containers[0].image" in orjson.loads(caught.value.body)["message"]


async def test_a_401_reads_the_credentials_again_and_retries_once():
    tokens_seen = []

    async def handler(request: web.Request) -> web.Response:
        tokens_seen.append(request.headers["Authorization"])
        if request.headers["Authorization"] != "Bearer rotated":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        return web.json_response({"ok": True})

    async with api_server(handler) as url:
        read, calls = credentials_from(url, ["expired", "rotated"])
        api = ApiClient(credentials=read)
        try:
            assert await api.request("GET", "/api/v1/namespaces/ns/secrets/s") == {"ok": True}
            assert tokens_seen == ["Bearer expired", "Bearer rotated"] and len(calls) == 2
        finally:
            await api.close()
        # Credentials that stay wrong: one retry, then the 401 is the caller's.
        read_bad, bad_calls = credentials_from(url, ["wrong"])
        api = ApiClient(credentials=read_bad)
        try:
            with pytest.raises(ApiError) as caught:
                await api.request("GET", "/x")
        finally:
            await api.close()
        assert caught.value.status == 401 and len(bad_calls) == 2  # read at the start, and once after the 401


async def test_a_watch_yields_each_event_line_until_the_server_ends_it():
    events = [{"type": "ADDED", "object": {"metadata": {"name": "l", "resourceVersion": "1"}}},
              {"type": "MODIFIED", "object": {"metadata": {"name": "l", "resourceVersion": "2"}}}]
    queries = []

    async def handler(request: web.Request) -> web.StreamResponse:
        queries.append(dict(request.query))
        response = web.StreamResponse()
        await response.prepare(request)
        for event in events:
            await response.write(orjson.dumps(event) + b"\n")
        await response.write_eof()
        return response

    async with api_server(handler) as url:
        api = ApiClient(credentials=credentials_from(url, ["t"])[0])
        try:
            got = [e async for e in api.watch("/apis/coordination.k8s.io/v1/namespaces/ns/leases",
                                              {"fieldSelector": "metadata.name=l"}, timeout=5)]
        finally:
            await api.close()
    assert got == events
    assert queries == [{"fieldSelector": "metadata.name=l", "watch": "true"}]


def test_in_a_pod_the_api_server_is_the_address_the_kubelet_gives_not_a_dns_name():
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}) == \
        "https://10.96.0.1:443"
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}) == \
        "https://[fd00::1]:6443"
    assert in_cluster_server({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}) is None
    assert in_cluster_server({}) is None


def test_the_operator_process_imports_no_kubernetes_client_library():
    """kopf imports kubernetes_asyncio and kubernetes when they are installed (they are, here: the tests use
    them). `rlkube operator` keeps them out, and nothing the operator imports needs them: the entry point runs up
    to the argument check of main.cli (after kopf and every handler module are imported)."""
    code = """
import sys
from rlkube import cli
try:
    cli.main(["operator", "--leader-elect", "--peering", "p"])
except SystemExit as exc:
    print("exit:", exc, file=sys.stderr)
import rlkube.controller.process.election, rlkube.controller.process.handlers, kopf
print(sorted(m for m in sys.modules if m.split(".")[0] in ("kubernetes", "kubernetes_asyncio", "pykube")
             and sys.modules[m] is not None))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "choose one" in out.stderr, out.stderr[-2000:]  # it got as far as main.cli
    assert out.stdout.strip() == "[]", out.stdout[:500]
