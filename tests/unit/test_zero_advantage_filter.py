"""spec.algorithm.filterZeroAdvantageGroups: groups whose rewards are all equal are dropped by the preprocessor,
counted, reported in the trainer's metrics, and credited back to the actors' lag counters so that the actors
sample replacements instead of holding for documents that never come (docs/design.md §7). Past
spec.algorithm.maxConsecutiveFilteredGroups in a row the preprocessor fails the job (ZeroAdvantageStall)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis

from support import specs
from rlkube.contract import protocol, runtime, zero_advantage
from rlkube.contract.context import RoleContext
from rlkube.core.errors import ConfigError
from rlkube.core.actor.lag import LagCounter
from rlkube.core.preprocessor.documents import DocumentConfig, documents_of, group_to_documents
from rlkube.core.preprocessor import role as preprocessor_role
from rlkube.core.preprocessor.role import PreprocessorRole
from rlkube.core.trainer import TrainerRole
from rlkube.lifecycle.evidence import Evidence, Failure
from rlkube.lifecycle.judgement import judge
from rlkube.lifecycle.validation import parse_spec

ON = DocumentConfig(filter_zero_advantage=True)


def group(rewards, gid="g", version=0, prompt=(1, 5, 6)):
    samples = [protocol.Sample([20 + i, 2], [-0.5, -0.5], r) for i, r in enumerate(rewards)]
    return protocol.RolloutGroup(gid, list(prompt), samples, model_version=version, expected_size=len(rewards))


def test_equal_rewards_are_filtered_and_others_kept():
    assert documents_of(group([1.0, 1.0, 1.0, 1.0]), ON) == ([], 1.0)
    assert documents_of(group([0.0, 0.0]), ON) == ([], 0.0)
    assert documents_of(group([0.3, 0.3 + 1e-9, 0.3]), ON) == ([], 0.3)  # within PipelineRL's epsilon
    docs, filtered_reward = documents_of(group([0.0, 0.0, 1.0, 0.0]), ON)
    assert len(docs) == 4 and filtered_reward is None and any(d.advantage != 0 for d in docs)
    # off (the pure default): equal groups become documents of advantage 0, as before
    docs = group_to_documents(group([1.0, 1.0, 1.0]), DocumentConfig())
    assert len(docs) == 3 and all(d.advantage == 0 for d in docs)
    # a singleton is dropped for having no baseline, not counted as filtered
    assert documents_of(group([1.0]), ON) == ([], None)


def test_the_equality_is_over_the_usable_samples():
    # the one sample that differs is too long and comes first: the remaining ones are all equal, and their reward
    # (not the dropped sample's) is the filtered group's
    g = group([0.0, 1.0, 1.0])
    g.samples[0].completion_tokens = list(range(40))
    g.samples[0].logprobs = [-1.0] * 40
    assert documents_of(g, DocumentConfig(max_length=10, filter_zero_advantage=True)) == ([], 1.0)


def _ctx(redis_url: str, **algorithm) -> RoleContext:
    task = {"task": {"dataset": {"path": "/data/sft.jsonl", "completionField": "completion"}}} if (
        algorithm.get("loss") == "sft") else {}
    spec = parse_spec(specs.spec(**{f"algorithm.{k}": v for k, v in algorithm.items()}, **task))
    return RoleContext("ns", "job", spec, redis_url)


def test_spec_switch_defaults_on_and_is_off_for_sft(redis_server, redis_client):
    assert _ctx(redis_server.url).spec.algorithm.filter_zero_advantage_groups is True
    assert PreprocessorRole(_ctx(redis_server.url), redis_client).cfg.filter_zero_advantage
    off = _ctx(redis_server.url, filterZeroAdvantageGroups=False)
    assert not PreprocessorRole(off, redis_client).cfg.filter_zero_advantage
    sft = _ctx(redis_server.url, loss="sft")  # (with a dataset's reference completions, which sft requires)
    assert not PreprocessorRole(sft, redis_client).cfg.filter_zero_advantage


@pytest.fixture(autouse=True)
def _short_reads(monkeypatch):
    """The drains below poll a fixed number of rounds over what is already in Redis: a round that finds nothing
    would otherwise block on the empty stream for the role's half second (READ_BLOCK_MS), about 20 s of this
    module's time spent waiting on nothing."""
    monkeypatch.setattr(preprocessor_role, "READ_BLOCK_MS", 10)
    monkeypatch.setattr(preprocessor_role, "HOLD_POLL_MS", 10)


def _drain(role: PreprocessorRole, rounds: int = 4) -> None:
    for _ in range(rounds):
        role.poll()


@pytest.mark.parametrize("switch", [True, False])
def test_filtered_groups_are_counted_credited_and_reported(redis_server, redis_client, switch):
    """Four groups of 4 written by an actor (lag.write advances `written`); two have equal rewards."""
    ctx = _ctx(redis_server.url, groupSize=4, samplesPerStep=8, maxLag=1, filterZeroAdvantageGroups=switch)
    keys = ctx.keys
    role = PreprocessorRole(ctx, redis_client)

    async def write_groups():
        client = aioredis.Redis.from_url(redis_server.url)
        lag = LagCounter(client, keys, max_lag=1, samples_per_step=8)
        for i, rewards in enumerate([[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]]):
            assert await lag.reserve(4, 0) is not None
            assert await lag.write(group([float(r) for r in rewards], f"g{i}"), 0) is not None
        out = await lag.reserved(), await lag.written()
        await client.aclose()
        return out

    assert asyncio.run(write_groups()) == (16, 16)  # the whole budget of version 0 (maxLag 1, 8 per step)
    _drain(role)
    docs = redis_client.xlen(keys.documents)
    metrics = TrainerRole._filtered(SimpleNamespace(leader=True, redis=redis_client, keys=keys))
    if switch:
        assert docs == 8 and role.filtered == 2
        assert metrics == {"filtered_groups": 2, "filtered_samples": 8}
        # the 8 filtered samples are no longer counted as written: positions count what reaches the trainer
        assert int(redis_client.get(keys.actor_samples_written)) == 8
        assert int(redis_client.get(keys.actor_samples_reserved)) == 8
    else:
        assert docs == 16 and role.filtered == 0
        assert metrics == {"filtered_groups": 0, "filtered_samples": 0}
        assert int(redis_client.get(keys.actor_samples_written)) == 16
    assert TrainerRole._filtered(SimpleNamespace(leader=False)) == {}


def test_dropped_groups_do_not_make_the_actors_wait_and_the_bound_holds(redis_server, redis_client):
    """Actors and preprocessor in lockstep against real Redis, half the groups of every round with equal rewards.
    Without the credit the actors would hold at the budget of version 0 forever (the trainer never gets a step
    of documents, so no weights_ready comes; only the stall release, one group per stall period, would move it).
    With it they sample replacements, the trainer fills its steps, and no consumed document is older than
    maxLag versions."""
    per_step, max_lag, n = 8, 1, 4
    ctx = _ctx(redis_server.url, groupSize=n, samplesPerStep=per_step, maxLag=max_lag)
    keys = ctx.keys
    role = PreprocessorRole(ctx, redis_client, max_ahead=10_000)

    async def run() -> tuple[int, int]:
        client = aioredis.Redis.from_url(redis_server.url)
        lag = LagCounter(client, keys, max_lag=max_lag, samples_per_step=per_step)
        seen, version, written, worst = 0, 0, 0, 0
        consumed: list[protocol.Document] = []
        for step in range(6):
            # the actors fill the budget of the newest version, every other group with equal rewards
            while await lag.reserve(n, seen) is not None:
                rewards = [1.0] * n if written % 2 == 0 else [1.0, 0.0, 0.0, 0.0]
                assert await lag.write(group(rewards, f"g{written}", version=version), seen) is not None
                written += 1
            _drain(role, rounds=8)
            # the trainer takes one step's documents if they are there
            entries = redis_client.xrange(keys.documents, "-", "+")[len(consumed):len(consumed) + per_step]
            if len(entries) < per_step:
                break
            docs = [protocol.decode_document(f) for _, f in entries]
            worst = max(worst, *(version - int(d.model_version[0]) for d in docs))
            consumed += docs
            version, seen = version + 1, len(consumed)
            assert await lag.on_weights_ready(f"{step + 1}-0", seen) == 0
        await client.aclose()
        return version, worst

    steps, worst = asyncio.run(run())
    assert steps == 6, "the trainer starved: dropped groups held the actors"
    assert worst <= max_lag
    assert role.filtered > 0


def _spec(**algorithm):
    task = {"task": {"dataset": {"path": "/data/sft.jsonl", "completionField": "completion"}}} if (
        algorithm.get("loss") == "sft") else {}
    return parse_spec(specs.spec(**{f"algorithm.{k}": v for k, v in algorithm.items()}, **task))


def test_the_stall_bound_defaults_to_ten_steps_of_groups_at_least_200_and_0_lifts_it():
    assert zero_advantage.limit(_spec(samplesPerStep=64, groupSize=16)) == 200  # 10 x 4 groups, floored
    assert zero_advantage.limit(_spec(samplesPerStep=512, groupSize=8)) == 640  # 10 x 64 groups
    assert zero_advantage.limit(_spec(samplesPerStep=50, groupSize=8)) == 200  # 7 groups a step (a partial one)
    assert zero_advantage.limit(_spec(samplesPerStep=4096, groupSize=3)) == 13660  # ceil(4096 / 3) = 1366
    assert zero_advantage.limit(_spec(maxConsecutiveFilteredGroups=5)) == 5
    assert zero_advantage.limit(_spec(maxConsecutiveFilteredGroups=0)) is None
    assert zero_advantage.limit(_spec(filterZeroAdvantageGroups=False, maxConsecutiveFilteredGroups=5)) is None
    assert zero_advantage.limit(_spec(loss="sft", maxConsecutiveFilteredGroups=5)) is None
    with pytest.raises(ValueError, match="maxConsecutiveFilteredGroups"):
        _spec(maxConsecutiveFilteredGroups=-1)


def _write(client, keys, groups) -> list[bytes]:
    return [client.xadd(keys.rollouts, group([float(r) for r in rewards], gid).encode()) for rewards, gid in groups]


def test_a_run_of_filtered_groups_past_the_bound_fails_the_role_naming_the_field(redis_server, redis_client):
    """Bound 3: two filtered, one useful (the run starts over), a singleton (dropped, neither counts nor resets),
    two filtered: no failure; the third filtered in a row raises ConfigError with the stall's message, after that
    group was acknowledged."""
    ctx = _ctx(redis_server.url, groupSize=4, samplesPerStep=8, maxConsecutiveFilteredGroups=3)
    role = PreprocessorRole(ctx, redis_client, max_ahead=10_000)
    _write(redis_client, ctx.keys, [([1, 1, 1, 1], "a"), ([0, 0, 0, 0], "b"), ([0, 1, 0, 0], "c"), ([1], "d"),
                                    ([0, 0, 0, 0], "e"), ([1, 1, 1, 1], "f")])
    _drain(role)
    assert (role.filtered, role.filtered_in_a_row, role.documents) == (4, 2, 4)
    _, after = _write(redis_client, ctx.keys, [([0, 0, 0, 0], "g"), ([1, 0, 1, 1], "h")])
    with pytest.raises(ConfigError) as failed:
        _drain(role)
    message = str(failed.value)
    assert message.startswith("spec.algorithm.maxConsecutiveFilteredGroups: zero-advantage stall: 3 rollout groups")
    assert "the bound being 3" in message and "(4 written by this preprocessor so far)" in message
    assert "filterZeroAdvantageGroups to false" in message and zero_advantage.is_stall(message)
    # "g" was acknowledged; "h", read in the same batch, stays pending for a restarted replica: nothing is lost
    pending = redis_client.xpending_range(ctx.keys.rollouts, protocol.ROLLOUTS_GROUP, "-", "+", 10)
    assert [p["message_id"] for p in pending] == [after]
    # the judgement: failed at once, with its own reason and the role's message
    failure = Failure("preprocessor", "tj-preprocessor-0", runtime.EXIT_CONFIG, message)
    o = judge(Evidence(now=datetime(2025, 1, 1, tzinfo=UTC), config_error=failure), ctx.spec).outcome
    assert (o.phase, o.reason) == ("Failed", "ZeroAdvantageStall") and "the bound being 3" in o.message


def test_without_a_bound_filtering_goes_on(redis_server, redis_client):
    ctx = _ctx(redis_server.url, groupSize=4, samplesPerStep=8, maxConsecutiveFilteredGroups=0)
    role = PreprocessorRole(ctx, redis_client, max_ahead=10_000)
    _write(redis_client, ctx.keys, [([1, 1, 1, 1], f"g{i}") for i in range(30)])
    _drain(role, rounds=8)
    assert (role.filtered, role.filtered_in_a_row) == (30, 30)
