"""`rlkube operator`: run the kopf operator (namespaces, peering or leader election, metrics and liveness).

With `--leader-elect`, any number of replicas may run: each one waits as a standby until it holds the
coordination.k8s.io Lease (election.py), and only then starts kopf, so only the leader has handlers, watches
and daemons at all (kopf's peering pauses operators but elects no leader). The leader renews the Lease while
kopf runs. If it cannot renew in time, or finds the Lease taken, it exits at once, without a graceful kopf
shutdown: that shutdown would let handlers finish their passes after another replica may have started, and the
Deployment restarts the process as a standby. On SIGTERM it stops kopf first and then releases the Lease, so a
rolling update hands over within one retry period instead of a whole lease duration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import urllib.parse
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from rlkube import gctune
from rlkube.controller.manifests import builders
from rlkube.controller.reconcile import metrics
from rlkube.controller.reconcile.apiclient import ApiClient
from rlkube.controller.process.election import LeaderElector, LeadershipLost, candidate_identity, lease_namespace
from rlkube.controller.process.handlers import build_registry
from rlkube.controller.process.lease import Timing

log = logging.getLogger(__name__)

EXIT_LEADERSHIP_LOST = 3
TLS_READ_BUFFER = 32 * 1024
"""Bytes asyncio reads from a TLS socket at once (CPython's SSLProtocol.max_size: 256 KiB)."""


def small_tls_read_buffers() -> None:
    """asyncio allocates (and zero-fills) a read buffer of SSLProtocol.max_size for every TLS connection: 256 KiB
    each, so the operator's ~75 connections to the API server held ~19 MB of mostly unused buffer at 1000 jobs. The
    bodies it reads are a few KB (watch lines, PATCH answers); a larger one only takes more reads. A class attribute
    of CPython's asyncio (3.11 and later), left alone where it is missing."""
    from asyncio import sslproto

    if isinstance(getattr(sslproto.SSLProtocol, "max_size", None), int):
        sslproto.SSLProtocol.max_size = TLS_READ_BUFFER


def cli(args: argparse.Namespace) -> int:
    if args.leader_elect and args.peering:
        # Peering would only add a second, weaker gate (it pauses, it does not elect) to the one that decides.
        raise SystemExit("--leader-elect and --peering: choose one (leader election makes peering unnecessary)")
    kopf.configure(verbose=False, log_prefix=True)
    # kopf logs every handler call at INFO (one line per pod event); keep its warnings and errors only.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    metrics.serve(args.metrics_port)
    builders.IMAGE_REGISTRY = args.image_registry or None
    if args.webhook_port:  # every replica answers admission reviews, standbys included (admission.py)
        from rlkube.controller.process import admission

        admission.serve(args.webhook_port, Path(args.webhook_cert_dir))
    gctune.tune()
    small_tls_read_buffers()
    namespaces = list(args.namespace or ())
    options = dict(
        registry=build_registry(namespaces),
        memo=kopf.Memo(),
        namespaces=namespaces,
        clusterwide=args.all_namespaces or not namespaces,
        # Without a peering object there is nothing to coordinate with: run alone unless one is named.
        standalone=args.standalone or args.peering is None,
        peering_name=args.peering,
        liveness_endpoint=args.liveness,
    )
    if not args.leader_elect:
        metrics.LEADER.set(1)  # the only operator: it acts
        kopf.run(**options)
        return 0
    return asyncio.run(run_elected(args, options))


async def run_elected(args: argparse.Namespace, options: dict[str, Any]) -> int:

    timing = Timing(args.lease_duration, args.lease_renew_deadline, args.lease_retry_period)
    api = ApiClient()
    elector = LeaderElector(api, lease_namespace(args.lease_namespace), args.lease_name, candidate_identity(), timing)
    metrics.LEADER.set(0)
    log.info("standby: waiting for lease %s/%s as %s", elector.namespace, elector.name, elector.identity)

    # SIGTERM/SIGINT before kopf runs (as a standby, or between winning the Lease and kopf's start): kopf gets
    # this as its stop flag, and replaces these handlers with its own once it starts.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with standby_health(args.liveness):
        acquiring = asyncio.ensure_future(elector.acquire())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait([acquiring, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not acquiring.done():
            acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
            log.info("stopped as a standby")
            await api.close()
            return 0
        acquiring.result()

    metrics.LEADER.set(1)

    async def raise_stop_flag(**_: Any) -> None:
        # kopf leaves its waiter on the stop flag pending when a signal stops it, then waits 5 s for that "hung"
        # task before returning: raising the flag as its cleanup begins lets the Lease go 5 s sooner.
        stop.set()

    kopf.on.cleanup(registry=options["registry"], id="stop-flag")(raise_stop_flag)

    def lost(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        reason = str(exc) if isinstance(exc, LeadershipLost) else f"the lease renewal failed: {exc!r}"
        log.critical("leadership lost (%s): exiting now so that only the new leader acts", reason)
        logging.shutdown()  # flush the log lines above; nothing else runs after this
        os._exit(EXIT_LEADERSHIP_LOST)

    # Created before kopf starts, so kopf's shutdown (which cancels every task it did not find) leaves it alone.
    holding = asyncio.create_task(elector.hold(), name="lease renewal")
    holding.add_done_callback(lost)
    try:
        await kopf.operator(**options, stop_flag=stop)
    finally:
        holding.remove_done_callback(lost)
        holding.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await holding
        metrics.LEADER.set(0)
        await elector.release()  # kopf has stopped: nothing of this process acts any more
        await api.close()
    return 0


@contextlib.asynccontextmanager
async def standby_health(endpoint: str | None):
    """kopf's liveness endpoint answers only once kopf runs; a standby answers it here meanwhile, so the
    Deployment's probes keep a healthy standby alive (and Ready). The port is handed to kopf afterwards."""
    if not endpoint:
        yield
        return
    parts = urllib.parse.urlsplit(endpoint)

    async def healthy(_: web.Request) -> web.Response:
        return web.json_response({"leader": False})

    app = web.Application()
    app.router.add_get(parts.path or "/", healthy)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, parts.hostname, parts.port).start()
    try:
        yield
    finally:
        await runner.cleanup()
