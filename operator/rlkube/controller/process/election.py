"""The Lease I/O of leader election: read, create, replace (with the read resourceVersion), release.

The decisions are lease.py's; this module only talks to the API server and keeps time. One `LeaderElector`
per operator process: `acquire()` returns once this process leads, `hold()` renews and raises
`LeadershipLost` when it can no longer be sure it leads, `release()` hands the Lease over on a graceful stop.

kubernetes_asyncio ships a leader elector, but it cannot release the Lease on shutdown (a rolling update would
wait a whole lease duration), stamps local time as UTC, logs a traceback for every lost race, and keeps no
`leaseTransitions`; the rules here are the same client-go rules it ports, on plain JSON (apiclient.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

from rlkube.controller.reconcile.apiclient import ApiClient, ApiError
from rlkube.controller.process.lease import (
    LeaseRecord, Seen, Timing, Verdict, decide, leading_lost, observe, release_spec,
)

log = logging.getLogger(__name__)

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
TRANSIENT = (ApiError, aiohttp.ClientError, OSError, TimeoutError)
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


class LeadershipLost(Exception):
    """This process may no longer act: the Lease was not renewed in time, or someone else holds it."""


def candidate_identity() -> str:
    """`<pod name or hostname>_<random>`: unique even for two processes on one host (or one restarted pod)."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


def lease_namespace(explicit: str | None) -> str:
    """--lease-namespace, else the pod's namespace (downward API or the service account), else an error."""
    if explicit:
        return explicit
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        raise SystemExit("--leader-elect needs --lease-namespace outside a pod (no POD_NAMESPACE)") from None


class LeaderElector:
    def __init__(
        self,
        api: ApiClient,
        namespace: str,
        name: str,
        identity: str,
        timing: Timing = Timing(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.api = api
        self.namespace, self.name, self.identity = namespace, name, identity
        self.collection = LEASES.format(namespace=namespace)
        self.timing, self.clock, self.wall = timing, clock, wall
        self.seen: Seen | None = None
        self.lease: dict | None = None  # the Lease as last read or written (its metadata is sent back)
        self.last_renewed: float | None = None  # monotonic time of the last successful write while leading

    # -- one attempt --------------------------------------------------------------------------------

    async def _read(self) -> dict | None:
        try:
            return await self.api.request("GET", f"{self.collection}/{self.name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def _look(self) -> Verdict:
        """Read the Lease and decide what to do with it."""
        lease = await self._read()
        now = self.clock()
        if lease is None:
            self.seen = None
        else:
            self.lease = lease
            self.seen = observe(self.seen, LeaseRecord.from_lease(lease), now)
        return decide(self.identity, self.seen, now, self.wall(), self.timing)

    async def _commit(self, verdict: Verdict, started: float) -> bool:
        """Write what `verdict` says; False when another candidate wrote first (nothing changed then)."""
        try:
            written = await self._write(verdict)
        except ApiError as exc:
            if exc.status != 409:
                raise
            # create: AlreadyExists; replace: the resourceVersion we read is stale.
            log.debug("lease %s/%s: lost a write race (%s)", self.namespace, self.name, verdict.kind)
            return False
        self.lease = written
        self.seen = Seen(LeaseRecord.from_lease(written), self.clock())
        self.last_renewed = started  # counted from before the read: conservative for the renew deadline
        return True

    async def attempt(self) -> Verdict:
        """One standby attempt: read the Lease, then create or take it, or wait (also after a lost race)."""
        started = self.clock()
        verdict = await self._look()
        if verdict.kind == "wait" or await self._commit(verdict, started):
            return verdict
        return Verdict("wait")

    async def _write(self, verdict: Verdict, spec: dict | None = None) -> dict:
        spec = spec if spec is not None else verdict.spec
        if verdict.kind == "create":
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            return await self.api.request("POST", self.collection, body)
        assert self.lease is not None
        # Replace with the resourceVersion that was read: a concurrent writer makes this a 409, never a lost update.
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": self.lease["metadata"],
                "spec": spec}
        return await self.api.request("PUT", f"{self.collection}/{self.name}", body)

    @property
    def holder(self) -> str:
        return self.seen.record.holder if self.seen is not None else ""

    # -- standby --------------------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Return once this process holds the Lease.

        Besides client-go's read every retry period, a standby watches the Lease: each renewal the leader
        makes restarts the standby's expiry clock the moment it is written, not up to a retry period later, so a
        dead leader is replaced `lease_duration` after its last renewal (within the lease duration of its death),
        and a released Lease is taken at once.
        """
        announced = None
        waited_from = self.clock()
        changed = asyncio.Event()
        watching = asyncio.create_task(self._watch(changed), name="lease watch")
        try:
            while True:
                try:
                    async with asyncio.timeout(self.timing.renew_deadline):
                        verdict = await self.attempt()
                except TRANSIENT as exc:
                    log.warning("lease %s/%s: cannot read or write it (%s); retrying", self.namespace, self.name,
                                exc)
                    verdict = Verdict("wait")
                if verdict.kind != "wait":
                    log.info("leading: lease %s/%s %s as %s after %.1fs as a standby (transitions %d)",
                             self.namespace, self.name, "created" if verdict.kind == "create" else "acquired",
                             self.identity, self.clock() - waited_from,
                             self.seen.record.transitions if self.seen else 0)
                    return
                if self.holder and self.holder != announced:
                    announced = self.holder
                    log.info("standby: lease %s/%s is held by %s", self.namespace, self.name, self.holder)
                await self._until_worth_trying(changed)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching

    async def _until_worth_trying(self, changed: asyncio.Event) -> None:
        """Sleep a retry period (with client-go's jitter), less when the Lease (as last read or watched) runs out
        or is released sooner."""
        poll_at = self.clock() + self.timing.retry_period * (1 + 0.2 * random.random())
        while True:
            now = self.clock()
            verdict = decide(self.identity, self.seen, now, self.wall(), self.timing)
            if verdict.kind != "wait":
                return
            until = min(poll_at, verdict.expires_at) if verdict.expires_at is not None else poll_at
            if until <= now:
                return
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), until - now + 0.005)

    async def _watch(self, changed: asyncio.Event) -> None:
        """Feed every version of the Lease into `seen` (its expiry clock) as it is written. Only `seen`: a write
        always follows a fresh read, so a decision never pairs one version's content with another's
        resourceVersion."""
        params = {"fieldSelector": f"metadata.name={self.name}", "timeoutSeconds": "300"}
        while True:
            try:
                async with contextlib.aclosing(self.api.watch(self.collection, params, timeout=330)) as events:
                    async for event in events:
                        if event["type"] in ("ADDED", "MODIFIED"):
                            record = LeaseRecord.from_lease(event["object"])
                            self.seen = observe(self.seen, record, self.clock())
                            changed.set()
                        elif event["type"] == "ERROR":
                            break  # e.g. 410 Gone: start a new watch
            except TRANSIENT as exc:
                log.debug("lease %s/%s: watch ended (%s)", self.namespace, self.name, exc)
            await asyncio.sleep(self.timing.retry_period)  # the reads every retry period go on meanwhile

    # -- leader ---------------------------------------------------------------------------------------

    async def hold(self) -> None:
        """Renew every retry period; raise LeadershipLost when that fails for the renew deadline or someone
        else holds the Lease. Never returns otherwise."""
        assert self.last_renewed is not None, "hold() after acquire()"
        while True:
            await asyncio.sleep(self.timing.retry_period)
            while True:
                now = self.clock()
                if leading_lost(self.last_renewed, now, self.timing):
                    raise LeadershipLost(f"lease {self.namespace}/{self.name} not renewed for "
                                         f"{now - self.last_renewed:.1f}s (deadline {self.timing.renew_deadline}s)")
                remaining = self.last_renewed + self.timing.renew_deadline - now
                try:
                    async with asyncio.timeout(remaining):
                        verdict = await self._look()
                        if verdict.kind != "renew":
                            # Someone else holds it, or it was released or deleted: leadership was not continuous.
                            raise LeadershipLost(f"lease {self.namespace}/{self.name} is no longer ours "
                                                 f"(holder {self.holder or 'none'})")
                        if await self._commit(verdict, now):
                            break
                        continue  # a concurrent write: read again at once
                except TRANSIENT as exc:
                    log.warning("lease %s/%s: renewal failed (%s)", self.namespace, self.name, exc)
                    await asyncio.sleep(min(self.timing.retry_period, max(remaining, 0.0)))

    async def release(self) -> bool:
        """Give the Lease up if this process still holds it (a graceful stop): a standby takes it at once."""
        if self.lease is None or self.holder != self.identity:
            return False
        try:
            async with asyncio.timeout(self.timing.retry_period * 2):
                self.lease = await self._write(Verdict("renew"), release_spec(self.seen.record, self.wall()))
        except TRANSIENT as exc:
            log.warning("lease %s/%s: could not release it (%s); it expires in %ss", self.namespace, self.name,
                        exc, self.timing.lease_duration)
            return False
        self.seen = Seen(LeaseRecord.from_lease(self.lease), self.clock())
        log.info("released lease %s/%s", self.namespace, self.name)
        return True
