"""Two operator replicas with `--leader-elect` against the real kube-apiserver (coordination.k8s.io/v1 Lease):

- the leader is killed (SIGKILL) in the middle of an ordered teardown, while a stage waits on a pod: the standby
  takes the Lease once it has expired, resumes the teardown from status.teardown, and no stage runs twice;
- a leader stopped gracefully (SIGTERM, a rolling update) releases the Lease and the standby takes it at once,
  and carries a running job on to its end;
- a leader that finds its Lease written by someone else exits at once (exit 3, no graceful kopf shutdown).
Lease changes are timed from a watch on the Lease; the takeover times are printed (`-s` shows them).
"""

# ruff: noqa: F811  (pytest fixtures imported from operator_harness are redefined as test parameters)
from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiohttp
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException
from support.operator_harness import (  # noqa: F401 (fixtures)
    Env,
    OperatorProcess,
    assert_stage_order,
    children,
    create_job,
    job_doc,
    kapi,
    wait_event,
)

from rlkube.controller.process.lease import Timing
from rlkube.controller.decisions.times import parse_time
from rlkube.lifecycle.roles import TEARDOWN_ORDER

pytestmark = pytest.mark.timeout(240)

LEASE = "rlkube-operator"
# Shorter than the defaults `rlkube operator --leader-elect` and the chart run with (15 s / 10 s / 2 s), through the
# same flags: two tests wait out a whole lease. The retry period stays (it bounds how soon a leader notices), and
# the renew deadline still leaves the leader more than two renewals before it gives up.
TIMING = Timing(lease_duration=8.0, renew_deadline=5.0, retry_period=2.0)


@dataclass
class LeaseChange:
    at: float = field(compare=False)  # monotonic, when the watch delivered it: not part of the version
    holder: str
    renew_time: str | None
    transitions: int


class LeaseRecorder:
    """Every version of one Lease, in watch order."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str):
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name = namespace, name
        self.changes: list[LeaseChange] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> LeaseRecorder:
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._watch(ready))
        await ready.wait()
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _watch(self, ready: asyncio.Event) -> None:
        selector = f"metadata.name={self.name}"
        rv = None
        while True:
            try:
                if rv is None:
                    listing = await self.coord.list_namespaced_lease(self.namespace, field_selector=selector)
                    rv = listing.metadata.resource_version
                    for lease in listing.items:
                        await self._record(self.coord.api_client.sanitize_for_serialization(lease))
                    ready.set()
                stream = watch.Watch().stream(self.coord.list_namespaced_lease, self.namespace,
                                              field_selector=selector, resource_version=rv, timeout_seconds=60)
                async with stream as events:
                    async for event in events:
                        if event["type"] == "ERROR":
                            rv = None
                            break
                        obj = event["raw_object"]
                        rv = obj["metadata"]["resourceVersion"]
                        await self._record(obj)
            except asyncio.CancelledError:
                raise
            except (TimeoutError, ApiException, OSError):
                rv = None
                await asyncio.sleep(0.2)

    async def _record(self, lease: dict) -> None:
        spec = lease.get("spec") or {}
        change = LeaseChange(time.monotonic(), spec.get("holderIdentity") or "", spec.get("renewTime"),
                             int(spec.get("leaseTransitions") or 0))
        if self.changes and self.changes[-1] == change:
            return  # a relist after a watch error sees the same version again: it was not written now
        self.changes.append(change)
        async with self._changed:
            self._changed.notify_all()

    @property
    def holder(self) -> str:
        return self.changes[-1].holder if self.changes else ""

    async def wait(self, predicate, timeout: float, what: str) -> LeaseChange:
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                raise TimeoutError(f"{what} not seen in {timeout}s: {self.changes[-5:]}") from None
        return self.changes[-1]


def held_by(operator: OperatorProcess, holder: str) -> bool:
    return holder.startswith(f"{operator.name}_")  # identity = POD_NAME + "_" + random suffix


async def leader_gauge(operator: OperatorProcess) -> float | None:
    try:
        text = await operator.metrics()
    except (TimeoutError, OSError, aiohttp.ClientError):
        return None
    match = re.search(r"^rlkube_operator_leader (\S+)$", text, re.M)
    return float(match.group(1)) if match else None


async def wait_gauge(operator: OperatorProcess, value: float, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (got := await leader_gauge(operator)) != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{operator.name}: rlkube_operator_leader is {got}, not {value}")
        await asyncio.sleep(0.1)  # the metrics endpoint has no watch


@pytest.fixture
async def ha(kapi, cluster, tmp_path):
    """A namespace with two `rlkube operator --leader-elect` processes (operator-a, operator-b) started together."""
    namespace = f"ha-{uuid.uuid4().hex[:8]}"
    args = ("--leader-elect", "--lease-name", LEASE, "--lease-namespace", namespace,
            "--lease-duration", str(TIMING.lease_duration), "--lease-renew-deadline", str(TIMING.renew_deadline),
            "--lease-retry-period", str(TIMING.retry_period))
    async with Env(kapi, cluster, namespace, tmp_path, operator_args=args, replicas=2) as env:
        yield env


async def elected(env: Env, leases: LeaseRecorder) -> tuple[OperatorProcess, OperatorProcess]:
    """(leader, standby): the Lease names one of the two, whose gauge says 1 while the other's says 0."""
    await leases.wait(lambda: bool(leases.holder), 60, "a Lease holder")
    (leader,) = [op for op in env.operators if held_by(op, leases.holder)]
    (standby,) = [op for op in env.operators if op is not leader]
    await wait_gauge(leader, 1)
    await wait_gauge(standby, 0)
    return leader, standby


def deletes(log: str, pod: str) -> int:
    """Graceful DELETEs an operator log shows it sent for `pod` (the reconcile log lists every action)."""
    return len(re.findall(rf"(?<!force-)delete Pod/{re.escape(pod)} \(grace", log))


async def test_the_standby_resumes_a_teardown_when_the_leader_is_killed(ha: Env, kapi):
    env, job = ha, "ha"
    async with LeaseRecorder(kapi, env.namespace, LEASE) as leases:
        leader, standby = await elected(env, leases)

        # Inference ignores SIGTERM and has a long grace period: the teardown waits in that stage.
        env.kubelet.held.add((job, "inference"))
        await create_job(kapi, env.namespace, job_doc(job, **{"teardown.gracePeriodSeconds.inference": 120}))
        trainer = await env.trainer(job)
        await env.recorder.wait_phase(job, "Running", timeout=60)
        await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
        await env.kubelet.exit(f"{job}-trainer-0", 0)
        await env.recorder.wait(
            lambda: (env.recorder.status(job).get("teardown") or {}).get("stage") == "inference", 30,
            "teardown waiting in the inference stage",
        )
        before = env.recorder.status(job)["teardown"]["stages"]
        assert [s["name"] for s in before] == ["actor", "preprocessor", "inference"]
        assert before[0]["finishedAt"] and before[1]["finishedAt"] and not before[2].get("finishedAt")
        assert await standby.passes(job) == 0  # the standby has not acted on anything

        leader_identity = leases.holder
        killed_at, killed_wall = time.monotonic(), datetime.now(UTC)
        leader.kill()  # SIGKILL: no release of the Lease, the stage's pod still deleting

        taken = await leases.wait(lambda: held_by(standby, leases.holder),
                                  TIMING.lease_duration + 3 * TIMING.retry_period, "the standby holding the Lease")
        # Read only now: a renewal written just before the kill can reach this watch after it (CI once measured
        # the takeover "2 s late": the recorder's last renewal then was the one before).
        last_renewal = [c for c in leases.changes if c.holder == leader_identity][-1]
        await standby.wait_passes(job, 1)
        first_pass = time.monotonic()
        await wait_gauge(standby, 1)
        # The held pod stops only now, so the new leader is the one that sees the inference stage through.
        await env.kubelet.release(job, "inference")
        await env.recorder.wait(
            lambda: (env.recorder.condition(job, "ResourcesReleased") or {}).get("status") == "True", 60,
            "ResourcesReleased=True",
        )
        status = await env.recorder.wait_phase(job, "Succeeded", timeout=30)

    kill_to_lease = taken.at - killed_at
    renewal_to_lease = taken.at - last_renewal.at
    print(f"\nleader kill -> standby holds the Lease: {kill_to_lease:.2f}s (last renewal -> Lease taken "
          f"{renewal_to_lease:.2f}s; kill -> first reconcile pass of the new leader {first_pass - killed_at:.2f}s; "
          f"lease duration {TIMING.lease_duration:.0f}s, retry period {TIMING.retry_period:.0f}s)")
    # Not before the Lease expired, and as soon as it did: the standby watches the Lease, so its expiry clock
    # started at the leader's last renewal (1 s: the watch's delivery and the read and write that take it).
    assert TIMING.lease_duration - 0.5 <= renewal_to_lease <= TIMING.lease_duration + 1.0
    assert kill_to_lease <= TIMING.lease_duration + 1.0
    assert taken.transitions == last_renewal.transitions + 1

    stages = status["teardown"]["stages"]
    assert [s["name"] for s in stages] == list(TEARDOWN_ORDER)  # each stage once
    for old, new in zip(before, stages):  # resumed, not restarted
        assert old["startedAt"] == new["startedAt"], old["name"]
    assert [s["finishedAt"] for s in stages[:2]] == [s["finishedAt"] for s in before[:2]]
    for later in stages[2:]:  # inference finished, and trainer and redis ran, under the new leader
        assert parse_time(later["finishedAt"]) > killed_wall, later
    for later in stages[3:]:
        assert parse_time(later["startedAt"]) > killed_wall, later
    assert all(s["forced"] == 0 for s in stages)

    # Every pod was asked to stop exactly once, by one of the two leaders, and nothing was recreated.
    pods = env.kubelet.job_pods(job)
    assert len(pods) == 5 and all(p.deleting_seq and p.gone_seq for p in pods)
    old_log, new_log = leader.log(), standby.log()
    for pod in pods:
        first, second = deletes(old_log, pod.name), deletes(new_log, pod.name)
        assert first + second == 1, (pod.name, first, second)
        assert (first == 1) == (pod.role in ("actor", "preprocessor", "inference")), (pod.name, pod.role)
    assert "force-delete" not in old_log + new_log
    # One Succeeded Event, from the new leader, listing each teardown stage once.
    [(_, _, released_event)] = await wait_event(kapi, env.namespace, job, "Succeeded")
    for role in TEARDOWN_ORDER:
        assert released_event.count(f"{role} stopped in") == 1, (role, released_event)
    assert_stage_order(env, job)

    released = env.recorder.condition(job, "ResourcesReleased")
    assert released["status"] == "True"
    assert await children(kapi, env.namespace, job) == {}  # nothing left
    assert "leading: lease" in new_log and f"is held by {leader_identity}" in new_log


async def test_a_leader_stopped_gracefully_hands_over_at_once(ha: Env, kapi):
    env, job = ha, "roll"
    async with LeaseRecorder(kapi, env.namespace, LEASE) as leases:
        leader, standby = await elected(env, leases)
        await create_job(kapi, env.namespace, job_doc(job))
        trainer = await env.trainer(job)
        await env.recorder.wait_phase(job, "Running", timeout=60)
        transitions = leases.changes[-1].transitions

        stopped_at = time.monotonic()
        leader.stop()  # SIGTERM, as a rolling update sends it: kopf stops, then the Lease is released
        assert leader.proc.returncode == 0, leader.log()[-2000:]
        await leases.wait(lambda: any(c.at >= stopped_at and not c.holder for c in leases.changes), 5,
                          "the Lease released")
        released = next(c for c in leases.changes if c.at >= stopped_at and not c.holder)
        taken = await leases.wait(lambda: held_by(standby, leases.holder), 3 * TIMING.retry_period,
                                  "the standby holding the Lease")
        await wait_gauge(standby, 1)

        # The handover waits neither for the lease to expire nor for the standby's next retry: it watches.
        handover = taken.at - released.at
        print(f"\ngraceful stop -> Lease released {released.at - stopped_at:.2f}s; released -> standby holds it "
              f"{handover:.2f}s (retry period {TIMING.retry_period:.0f}s)")
        assert handover <= 1.0
        assert taken.transitions == transitions + 1

        # The new leader carries the running job on to its end.
        await standby.wait_passes(job, 1)
        await trainer.finished(step=40, checkpoint="/checkpoints/step-40")
        await env.kubelet.exit(f"{job}-trainer-0", 0)
        status = await env.recorder.wait_phase(job, "Succeeded", timeout=60)
    assert [s["name"] for s in status["teardown"]["stages"]] == list(TEARDOWN_ORDER)
    assert await children(kapi, env.namespace, job) == {}
    assert "delete Pod/" not in leader.log()  # the whole teardown was the new leader's


async def test_a_leader_that_finds_its_lease_taken_exits_at_once(ha: Env, kapi):
    env = ha
    coord = client.CoordinationV1Api(kapi)
    async with LeaseRecorder(kapi, env.namespace, LEASE) as leases:
        leader, standby = await elected(env, leases)
        # Someone else writes the Lease (as a partitioned leader's successor would): the leader must stop acting.
        lease = await coord.read_namespaced_lease(LEASE, env.namespace)
        lease.spec.holder_identity = "intruder_0"
        await coord.replace_namespaced_lease(LEASE, env.namespace, lease)
        written = time.monotonic()
        code = await asyncio.to_thread(leader.proc.wait, 2 * TIMING.retry_period + 5)
        exited = time.monotonic() - written
        assert code == 3, leader.log()[-2000:]  # EXIT_LEADERSHIP_LOST, without a graceful kopf shutdown
        assert "leadership lost (lease" in leader.log() and "intruder_0" in leader.log()
        # The intruder never renews: the standby takes the Lease when it expires, not before.
        assert await leader_gauge(standby) == 0
        taken = await leases.wait(lambda: held_by(standby, leases.holder), 2 * TIMING.lease_duration,
                                  "the standby holding the Lease")
    # Safety, whatever the machine's load: the old leader had stopped before anyone could lead again, and the
    # standby did not take a Lease that had not expired. How soon after the expiry it took it is a latency (the
    # watch event, one read and one write through a busy API server): printed, not asserted.
    assert exited < taken.at - written
    assert taken.at - written >= TIMING.lease_duration - 0.5
    print(f"\nLease taken from the leader -> it exited {exited:.2f}s later; the standby took the expired Lease "
          f"{taken.at - written:.2f}s after that write")
