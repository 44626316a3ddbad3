"""The sandbox server: `POST /run` with `{"code": ...}` runs the snippet and answers its SandboxResult as JSON;
`GET /healthz` answers the network layers a snippet gets and the limits (the pod's readiness probe).

The limits are the launcher's (runtime.ENV_SANDBOX_LIMITS, from spec.task.environment.sandbox), never the
caller's: an actor cannot ask for more. Snippets run on threads (each one a child process,
rlkube.core.actor.sandbox.Sandbox), at most `concurrency` at once; the rest wait their turn. Each gets a fresh
directory under runtime.ENV_SANDBOX_WORK (the pod's emptyDir), removed after it.

The snippet's network: a user + network namespace of its own per snippet (only a loopback that is down), which
holds whatever the cluster's CNI does with NetworkPolicy. Under gVisor (runsc) the sandbox's own kernel grants
it to the pod's non-root user; under runc the container runtime's default seccomp profile refuses
unshare(CLONE_NEWUSER). With runtime.ENV_SANDBOX_REQUIRE_NETNS=1 (spec.sandbox.requireNetworkNamespace) a
server that cannot make one exits EXIT_CONFIG at start, naming the field to fix, instead of serving snippets
that only the audit hook holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Any

from aiohttp import web

from rlkube.contract import runtime
from rlkube.core.actor.sandbox import LAYERS, Sandbox, SandboxLimits, network_namespace_available
from rlkube.core.errors import ConfigError

log = logging.getLogger("rlkube.sandbox")

MAX_CODE_BYTES = 1 << 20
"""Largest request body (the snippet and its JSON framing)."""


class SandboxServer:
    def __init__(self, sandbox: Sandbox, concurrency: int):
        self.sandbox = sandbox
        self.slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.served = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_CODE_BYTES)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_post("/run", self.run)
        return app

    async def healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"layers": list(self.sandbox.layers), "limits": self.sandbox.limits.to_json(),
                                  "concurrency": self.concurrency, "served": self.served})

    async def run(self, request: web.Request) -> web.Response:
        try:
            body: Any = await request.json()
        except ValueError:
            return web.json_response({"error": "the body is not JSON"}, status=400)
        code = body.get("code") if isinstance(body, dict) else None
        if not isinstance(code, str):
            return web.json_response({"error": "`code` (a string) is required"}, status=400)
        async with self.slots:
            result = await asyncio.to_thread(self.sandbox.run, code)
        self.served += 1
        return web.json_response(result.to_json())


def sandbox_from_env(environ: dict[str, str]) -> Sandbox:
    """The Sandbox the launcher configured; ConfigError when it asked for a network namespace this host refuses."""
    raw = environ.get(runtime.ENV_SANDBOX_LIMITS)
    limits = SandboxLimits.from_json(json.loads(raw)) if raw else SandboxLimits()
    asked = environ.get(runtime.ENV_SANDBOX_LAYERS)
    layers = tuple(x for x in asked.split(",") if x) if asked else LAYERS
    unknown = set(layers) - set(LAYERS)
    if unknown or not layers:
        raise ConfigError("spec.sandbox.template", f"{runtime.ENV_SANDBOX_LAYERS}={asked!r}: some of {LAYERS}")
    if "netns" in layers and not network_namespace_available():
        if environ.get(runtime.ENV_SANDBOX_REQUIRE_NETNS) == "1":
            raise ConfigError("spec.sandbox.runtimeClassName",
                              "this pod's runtime refuses a snippet a network namespace of its own "
                              "(unshare(CLONE_NEWUSER|CLONE_NEWNET): under runc the default seccomp profile refuses "
                              "it); run sandbox pods under gVisor (runtimeClassName of a runsc handler), or set "
                              "spec.sandbox.requireNetworkNamespace false to rely on the audit hook and the "
                              "NetworkPolicy alone")
        layers = tuple(x for x in layers if x != "netns")
        if not layers:
            raise ConfigError("spec.sandbox.template", "no network namespace here and the audit hook turned off")
    return Sandbox(limits, layers=layers, work_root=environ.get(runtime.ENV_SANDBOX_WORK) or None)


async def serve(host: str, port: int, sandbox: Sandbox, concurrency: int, stop: asyncio.Event) -> None:
    runner = web.AppRunner(SandboxServer(sandbox, concurrency).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("sandbox server on %s:%d: network layers %s, limits %s, %d at once", host, port,
             ",".join(sandbox.layers), sandbox.limits, concurrency)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = dict(os.environ)
    sandbox = sandbox_from_env(env)
    host = env.get(runtime.ENV_BIND_HOST, "127.0.0.1")
    port = int(env.get(runtime.ENV_PORT, runtime.SANDBOX_PORT))
    concurrency = max(1, int(env.get(runtime.ENV_SANDBOX_CONCURRENCY, "4")))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(host, port, sandbox, concurrency, stop)

    asyncio.run(run())
    return 0
