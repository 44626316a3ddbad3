"""The shared lag counters over real Redis: the bound across concurrent reservations, the write-time check in
stream order, the restart rebase (once per event, in event order), and the stall release (once per period)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from rlkube.contract import protocol
from rlkube.core.actor.lag import LagCounter
from rlkube.contract.protocol import RolloutGroup, Sample, StreamKeys
from rlkube.contract.streams import ensure_group

KEYS = StreamKeys("ns/job/")


@pytest.fixture
async def counter(redis_server, redis_client):
    client = aioredis.Redis.from_url(redis_server.url)
    yield LagCounter(client, KEYS, max_lag=1, samples_per_step=8)
    await client.aclose()


async def test_concurrent_reservations_never_pass_the_bound(counter):
    # maxLag 1, 8 per step, nothing consumed: 16 samples, i.e. 4 groups of 4 out of 20 attempts.
    got = await asyncio.gather(*(counter.reserve(4, 0) for _ in range(20)))
    assert sorted(g for g in got if g is not None) == [4, 8, 12, 16]
    assert await counter.reserved() == 16
    assert await counter.reserve(4, 8) == 20  # the trainer consumed 8 documents


def group(version: int, n: int = 4) -> RolloutGroup:
    return RolloutGroup(f"g{version}", [1, 4], [Sample([5], [-0.5], 1.0) for _ in range(n)], version, n)


async def test_write_checks_the_position_against_the_sampling_version(counter, redis_client):
    # version 0 announced at 0 documents: positions up to 16; version 1 at 8 documents: up to 24.
    assert [await counter.write(group(0), 0) for _ in range(4)] == [4, 8, 12, 16]
    assert await counter.write(group(0), 0) is None  # would be consumed 2 versions after version 0
    assert await counter.write(group(1), 8) == 20
    assert await counter.written() == 20
    stream = redis_client.xrange(KEYS.rollouts)
    assert [RolloutGroup.decode(f).model_version for _, f in stream] == [0, 0, 0, 0, 1]


async def test_a_written_group_adds_its_episode_counts_in_the_same_script_and_a_refused_one_adds_none(
        counter, redis_client):
    totals = {"episodes": 4, "truncated": 3, "turn_reward_sum": 0.75}
    assert [await counter.write(group(0), 0, totals) for _ in range(4)] == [4, 8, 12, 16]
    assert await counter.write(group(0), 0, {"episodes": 4, "truncated": 4}) is None  # refused: not counted
    assert await counter.write(group(1), 8) == 20  # no environment: no counts
    counts = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.episodes).items()}
    assert counts == {"episodes": "16", "truncated": "12", "turn_reward_sum": "3"}
    assert redis_client.xlen(KEYS.rollouts) == 5


async def test_rebase_lowers_once_and_ignores_older_events(counter):
    assert [await counter.reserve(8, 16) for _ in range(4)] == [8, 16, 24, 32]
    assert [await counter.write(group(2, 8), 16) for _ in range(4)] == [8, 16, 24, 32]
    assert await counter.on_weights_ready("100-0", 8) == 0
    assert await counter.on_weights_ready("101-0", 16) == 0
    # a restarted trainer resumed at 8 documents: lowered by 8, once, however many replicas apply it
    assert await counter.on_weights_ready("200-0", 8) == 8
    assert await counter.on_weights_ready("200-0", 8) == 0
    assert (await counter.reserved(), await counter.written()) == (24, 24)
    # a replica lagging behind applies an older event afterwards: ignored (it would look like a restart)
    assert await counter.on_weights_ready("101-0", 16) == 0
    assert await counter.on_weights_ready("99-5", 0) == 0
    assert await counter.reserved() == 24
    # ids compare as numbers, not strings ("1000-0" is newer than "999-9")
    assert await counter.on_weights_ready("999-9", 8) == 0
    assert await counter.on_weights_ready("1000-0", 0) == 8


async def test_stall_release_drops_unwritten_reservations_first_then_releases_credit(counter):
    await counter.reserve(8, 0)
    await counter.write(group(0, 8), 0)
    await counter.reserve(4, 0)  # reserved by an actor that was then killed: never written
    results = await asyncio.gather(*(counter.release_if_stalled(4, 30) for _ in range(5)))
    assert results.count(None) == 4 and "unwritten reservations" in results  # once per period
    assert (await counter.reserved(), await counter.written()) == (8, 8)

    await counter.redis.delete(counter.keys.stall_release)  # the 30 s period is over
    what = await counter.release_if_stalled(4, 30)
    assert what == "one group of credit"
    assert (await counter.reserved(), await counter.written()) == (4, 4)


async def test_stall_release_keeps_the_groups_this_replica_is_sampling(counter):
    await counter.reserve(4, 0)  # a dead actor's, never written
    await counter.reserve(4, 0)  # this replica's own group, still being sampled (slow, not lost)
    assert await counter.release_if_stalled(4, 30, inflight=4) == "unwritten reservations"
    assert (await counter.reserved(), await counter.written()) == (4, 0)

    await counter.redis.delete(counter.keys.stall_release)  # the 30 s period is over
    assert await counter.release_if_stalled(4, 30, inflight=4) is None  # only our own group is unwritten
    assert (await counter.reserved(), await counter.written()) == (4, 0)


async def test_trainer_starving_reads_the_documents_group(counter, redis_client):
    assert await counter.trainer_starving()  # no documents stream yet
    ensure_group(redis_client, KEYS.documents, protocol.DOCUMENTS_GROUP)
    for i in range(8):
        redis_client.xadd(KEYS.documents, {"tokens": b"", "data": str(i)})
    assert not await counter.trainer_starving()  # a whole step (8) waits for the trainer
    redis_client.xreadgroup("fast_llm_group", "c0", {KEYS.documents: ">"}, count=1, noack=True)
    assert await counter.trainer_starving()
