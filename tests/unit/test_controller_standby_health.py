"""A standby operator answers the liveness endpoint (kopf serves it only once it runs), and frees the port for
kopf when it becomes the leader."""

from __future__ import annotations

import socket

import aiohttp
import psutil
import pytest

from rlkube.controller.process.main import standby_health
from rlkube.local.ports import free_port


async def test_standby_answers_the_liveness_endpoint_then_frees_the_port():
    port = free_port()
    url = f"http://127.0.0.1:{port}/healthz"
    async with aiohttp.ClientSession() as session:
        async with standby_health(url):
            async with session.get(url) as r:
                assert r.status == 200 and await r.json() == {"leader": False}
            async with session.get(f"http://127.0.0.1:{port}/other") as r:
                assert r.status == 404
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(url) as r:
                pass
    with socket.socket() as s:  # kopf can bind it now
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _listening() -> set:
    """The TCP addresses this process listens on."""
    proc = psutil.Process()
    conns = proc.net_connections("inet") if hasattr(proc, "net_connections") else proc.connections("inet")
    return {c.laddr for c in conns if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("endpoint", [None, ""])
async def test_no_endpoint_serves_nothing(endpoint):
    # Without --liveness the standby opens no listener at all: there is no port for it to answer on or hand over.
    before = _listening()
    async with standby_health(endpoint) as served:
        assert served is None
        assert _listening() == before
    assert _listening() == before
