"""The validating admission webhook: `kubectl apply` (and `--dry-run=server`) refuses a bad TrainingJob at once.

Why: the operator's own checks (lifecycle/validation.py, the job-name rule of names.py) run after the object is
stored, so a GitOps pipeline or a user sees `created` and only later a Failed job. KubeRay, JobSet and Kubeflow
Trainer refuse at apply time; so do we, with exactly the operator's rules (`job_io.parsed_spec`), naming the field.
The operator keeps its checks for objects stored without the webhook (not installed, failurePolicy Ignore).

Only CREATE is reviewed (the chart's rule): the operator itself updates its jobs (finalizers), and a job stored
before the webhook existed must still be deletable, so an UPDATE is never refused here. Written on aiohttp rather
than kopf's admission server because every replica must answer, standbys included: kopf runs only in the leader
(main.py). It runs on a thread of its own, with its own event loop, beside kopf's.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
from pathlib import Path
from typing import Any

from aiohttp import web

from rlkube.api.spec import API_VERSION, KIND
from rlkube.controller.reconcile.job_io import parsed_spec

log = logging.getLogger(__name__)

PATH = "/validate-trainingjob"
"""The URL path the ValidatingWebhookConfiguration calls."""
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"
"""The files of a kubernetes.io/tls Secret, mounted as the certificate directory."""


def review(request: dict[str, Any]) -> dict[str, Any]:
    """The AdmissionReview (admission.k8s.io/v1) answering `request`: allowed, or refused with the operator's
    message naming every bad field (HTTP 422, reason Invalid, as the API server's own schema errors)."""
    req = request.get("request") or {}
    response: dict[str, Any] = {"uid": req.get("uid", ""), "allowed": True}
    obj = req.get("object") or {}
    if req.get("operation") == "CREATE" and obj.get("kind") == KIND and obj.get("apiVersion") == API_VERSION:
        name = (obj.get("metadata") or {}).get("name") or ""
        _, problem = parsed_spec(name, dict(obj.get("spec") or {}))
        if problem is not None:
            response = {"uid": response["uid"], "allowed": False,
                        "status": {"code": 422, "reason": "Invalid", "message": f"TrainingJob {name}: {problem}"}}
            log.info("refused TrainingJob %s/%s%s: %s", req.get("namespace"), name,
                     " (dry run)" if req.get("dryRun") else "", problem)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


async def _handle(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "an AdmissionReview JSON body is required"}, status=400)
    return web.json_response(review(body))


def tls_context(cert_dir: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_dir / CERT_FILE, cert_dir / KEY_FILE)
    return ctx


def serve(port: int, cert_dir: Path, host: str = "0.0.0.0", timeout: float = 30) -> None:
    """Serve the webhook over TLS on a daemon thread, returning once it listens. A certificate that cannot be
    loaded or a port that cannot be bound raises here, before the operator starts (its pod then fails saying
    why)."""
    ctx = tls_context(cert_dir)
    ready = threading.Event()
    failed: list[BaseException] = []

    async def run() -> None:
        app = web.Application()
        app.router.add_post(PATH, _handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, ssl_context=ctx).start()
        log.info("admission webhook serving https://%s:%d%s", host, port, PATH)
        ready.set()
        await asyncio.Event().wait()  # until the process exits (a daemon thread)

    def thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # reported to the caller below, and logged if it comes later
            failed.append(exc)
            log.exception("the admission webhook stopped")
            ready.set()

    threading.Thread(target=thread, name="admission webhook", daemon=True).start()
    if not ready.wait(timeout):
        raise RuntimeError(f"the admission webhook did not listen on port {port} within {timeout:.0f} s")
    if failed:
        raise RuntimeError(f"the admission webhook cannot serve on port {port}: {failed[0]}") from failed[0]
