"""Generated trainer event streams (hypothesis) through the real reader into the operator's pure decisions.

Each case writes one stream to a real redis-server (malformed JSON, JSON that is not an object, bytes that are
not UTF-8, unknown and mistyped types, fields of every JSON type, numbers beyond int64 and double, oversized
payloads, duplicates, steps out of order, explicit ids from 1970 to beyond year 9999), reads it back with
streams.EventReader in random batch sizes, one reconcile pass (`decisions.decide`) per batch, as the watcher
feeds the operator, then a last pass where the trainer pod has (or has not) exited 0. Properties:
- nothing raises: not the reader, not the decisions; the operator's real EventWatcher reads the same stream to its
  end, stays alive and buffers the same events;
- every status is one the API server can store and the next pass can read back (int64 integers, small);
- the job Succeeded only on a well-formed training_finished for maxSteps (generated_events.full_finish, an
  oracle written from the contract) from the running trainer, with the trainer's exit 0 or a checkpoint;
- when a well-formed final training_finished is the stream's last and the trainer exits 0, it Succeeded.
The seed and the number of cases are printed (fuzz_seed.py).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import orjson
import pytest
import redis
from support.generated_events import INT64, Entry, event_stream, full_finish
from support.fuzz_seed import say, scaled, seed
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from rlkube.api.spec import MAX_SECONDS
from rlkube.api.status import TrainingJobStatus
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.decisions.recipe import JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed, PodView
from rlkube.controller.reconcile.watcher import EventWatcher, Target
from rlkube.contract import protocol
from rlkube.contract.streams import EventReader
from support import specs

pytestmark = pytest.mark.timeout(900)

CASES = scaled(300)
STATIC = frozenset({"ConfigMap/j-config", "Secret/j-redis", "Service/j-redis", "Service/j-inference",
                    "Service/j-trainer"})
MAX_STATUS_BYTES = 64 * 1024
"""A status is a few KiB; one that grows with what a producer writes would some day exceed what etcd stores."""


def pod(role: str, started: datetime, phase: str = "Running", exit_code: int | None = None) -> PodView:
    name = "j-redis" if role == "redis" else f"j-{role}-0"
    return PodView(name=name, uid=f"uid-{name}", role=role, index=0, phase=phase, ready=phase == "Running",
                   started_at=started, pod_ip="10.0.0.9", exit_code=exit_code)


def pods(started: datetime, trainer_exited: bool) -> tuple[PodView, ...]:
    trainer = pod("trainer", started, "Succeeded", 0) if trainer_exited else pod("trainer", started)
    return tuple(trainer if r == "trainer" else pod(r, started)
                 for r in ("redis", "trainer", "inference", "preprocessor", "actor"))


def job(raw: dict, status: TrainingJobStatus) -> JobView:
    return JobView("ns", "j", "uid-j", 1, raw, parse_spec(raw), None, False, status)


def observed(pods_: tuple, events=(), read_upto=None) -> Observed:
    return Observed(pods=pods_, events=tuple(events), read_upto=read_upto,
                    event_source=EventSource("Reachable", "Connected", "redis", caught_up=True),
                    events_read_to_end=True, static_present=STATIC)


def ints(node) -> list[int]:
    if isinstance(node, bool):
        return []
    if isinstance(node, int):
        return [node]
    if isinstance(node, dict):
        return [i for v in node.values() for i in ints(v)]
    if isinstance(node, list):
        return [i for v in node for i in ints(v)]
    return []


def check_storable(status: TrainingJobStatus) -> None:
    doc = status.model_dump(by_alias=True, mode="json", exclude_none=True)
    text = orjson.dumps(doc)
    assert len(text) < MAX_STATUS_BYTES, f"status of {len(text)} bytes"
    assert all(INT64[0] <= i <= INT64[1] for i in ints(doc)), f"status integer beyond int64: {doc}"
    TrainingJobStatus.model_validate(orjson.loads(text))  # what the next pass parses (job_io.parse_status)


def write(client: redis.Redis, stream: str, entries: list[Entry]) -> list[tuple[str, Entry]]:
    written = []
    for entry in entries:
        sid = "*" if entry.ms is None else f"{entry.ms}-0"
        try:
            got = client.xadd(stream, entry.fields, id=sid)
        except redis.ResponseError:  # an explicit id at or below the top: Redis refuses it; let it pick one
            got = client.xadd(stream, entry.fields)
        written.append((protocol.text(got), entry))
    return written


class Watchers:
    """The operator's EventWatcher, one per case, on an event loop of its own (a thread). A watcher is stopped in
    the background, so no case waits for its reader to be cancelled (EventWatcher.stop re-cancels a reader that
    redis-py kept in its XREAD, for up to STOP_TIMEOUT)."""

    def __init__(self, url: str):
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stopping: list[asyncio.Task] = []

    def reads(self, stream: str, last_id: str) -> tuple[bool, list[str]]:
        """(still running after reading the stream to `last_id`, the ids it buffered)."""
        return asyncio.run_coroutine_threadsafe(self._reads(stream, last_id), self.loop).result(60)

    async def _reads(self, stream: str, last_id: str) -> tuple[bool, list[str]]:
        woken = asyncio.Event()
        watcher = EventWatcher(Target(self.url, None, stream), None, woken.set).start()
        try:
            async with asyncio.timeout(30):
                while protocol.stream_id_key(watcher.last_id) < protocol.stream_id_key(last_id):
                    if watcher._task.done():
                        watcher._task.result()  # raises what killed it
                        break
                    woken.clear()
                    await woken.wait()
            return not watcher._task.done(), [e.stream_id for e in watcher.buffer]
        finally:
            self.stopping.append(asyncio.create_task(watcher.stop()))

    def close(self) -> None:
        async def stop_all():
            await asyncio.gather(*self.stopping)
        asyncio.run_coroutine_threadsafe(stop_all(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


SEED = seed()


def test_generated_trainer_event_streams_never_raise_nor_complete_a_job_wrongly(redis_server, capsys):
    say(capsys, f"trainer event streams: seed {SEED} (replay: RLKUBE_FUZZ_SEED={SEED}), {CASES} cases planned")
    client = redis_server.client()
    watchers = Watchers(redis_server.url)
    stats: Counter = Counter()

    spec_knobs = st.fixed_dictionaries({
        "maxSteps": st.integers(1, 100),
        "completionTimeoutSeconds": st.one_of(st.integers(2, 600), st.integers(601, MAX_SECONDS)),
        "eventTimeoutSeconds": st.one_of(st.just(0), st.integers(1, 900), st.just(MAX_SECONDS)),
        "ttl": st.one_of(st.none(), st.integers(0, 60), st.just(MAX_SECONDS)),
    })

    @hypothesis_seed(SEED)
    @settings(max_examples=CASES, deadline=None, database=None, derandomize=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(knobs=spec_knobs, data=st.data(), batch=st.integers(1, 8), trainer_exits=st.booleans(),
           good_last=st.booleans())
    def case(knobs, data, batch, trainer_exits, good_last):
        max_steps = knobs["maxSteps"]
        entries = data.draw(event_stream(max_steps), label="stream")
        if good_last:
            entries = [*entries, Entry(protocol.training_finished(step=max_steps, checkpoint="/checkpoints/final"),
                                       label="good-final")]
        raw = specs.spec(**{"algorithm.maxSteps": max_steps,
                            "runPolicy.completionTimeoutSeconds": knobs["completionTimeoutSeconds"],
                            "runPolicy.eventTimeoutSeconds": knobs["eventTimeoutSeconds"]})
        if knobs["ttl"] is not None:
            raw["runPolicy"]["ttlSecondsAfterFinished"] = knobs["ttl"]

        stream = f"fuzz/{uuid.uuid4().hex}/{protocol.EVENTS_STREAM}"
        written = write(client, stream, entries)
        try:
            stats["cases"] += 1
            stats["entries"] += len(written)
            for _, e in written:
                stats[e.label.split(":")[0]] += 1
            t0 = datetime.now(UTC)
            started = t0 - timedelta(minutes=5)
            running = pods(started, trainer_exited=False)

            status = TrainingJobStatus()
            for i in range(2):  # Pending -> Running with every pod up
                status = decide(job(raw, status), observed(running), t0 - timedelta(minutes=2 - i)).status
            assert status.phase == "Running"

            reader = EventReader(client, stream, "0-0")
            decoded: list[str] = []
            last_id = written[-1][0] if written else "0-0"
            now = t0
            while protocol.stream_id_key(reader.last_id) < protocol.stream_id_key(last_id):
                events = reader.read(count=batch)
                decoded += [e.stream_id for e in events]
                now += timedelta(milliseconds=1)
                d = decide(job(raw, status), observed(running, events, reader.last_id), now)
                check_storable(d.status)
                status = d.status
            assert reader.last_id == last_id  # read past every entry, malformed ones included
            if written:
                assert status.trainer.last_event_id == last_id

            end = pods(started, trainer_exited=trainer_exits)
            finals = [now + timedelta(seconds=1)]
            if knobs["completionTimeoutSeconds"] <= 600:
                finals.append(now + timedelta(seconds=knobs["completionTimeoutSeconds"] + 1))
            for when in finals:
                d = decide(job(raw, status), observed(end), when)
                check_storable(d.status)
                status = d.status

            alive, buffered = watchers.reads(stream, last_id)
            assert alive and buffered == decoded

            succeeded = next((c for c in status.conditions if c.type == "Succeeded" and c.status == "True"), None)
            full = {sid: full_finish(e.fields, max_steps, [f.fields for _, f in written[:i]])
                    for i, (sid, e) in enumerate(written)}
            if succeeded is not None:
                stats["succeeded"] += 1
                sid = status.completion.stream_id
                payload = full.get(sid)
                assert payload is not None, f"Succeeded on {sid}, not a well-formed final training_finished"
                assert protocol.stream_id_key(sid)[0] >= started.timestamp() * 1000, "a finish from before the trainer started"
                assert trainer_exits or (isinstance(payload.get("checkpoint"), str) and payload["checkpoint"])
            junk_ids = [e.ms for e in entries if e.ms is not None]
            if good_last and trainer_exits and not junk_ids:
                stats["must_succeed"] += 1
                assert succeeded is not None, (status.reason, status.message)
                assert status.completion.stream_id == written[-1][0]
        finally:
            client.delete(stream)

    try:
        case()
    finally:
        say(capsys, f"trainer event streams: seed {SEED}: {stats['cases']} cases run, {stats['entries']} entries "
                    f"({', '.join(f'{k} {v}' for k, v in sorted(stats.items()) if k not in ('cases', 'entries'))})")
        watchers.close()
        client.close()
    assert stats["cases"] >= CASES
