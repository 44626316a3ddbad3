"""The agent and evaluation counters (rlkube.contract.counters): each typed once by name, whatever values a group
carries, through the actors' write script on a real Redis, the trainer's reading of the hash, and the one reading
of the metrics events that the operator's status and `rlkube local` share."""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from support import specs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from support.trainer_events import decide_running, event
from rlkube.api.status import AgentStatus
from rlkube.contract import counters, protocol
from rlkube.core.actor.episodes import EpisodeResult
from rlkube.core.actor.lag import LagCounter
from rlkube.core.actor.role import Actor
from rlkube.lifecycle import progress
from rlkube.lifecycle.validation import parse_spec
from rlkube.local.runner import LocalJob, RunResult

KEYS = protocol.StreamKeys("ns/job/")


def test_every_counter_has_one_type_and_the_status_types_match_it():
    assert set(counters.EPISODE) | set(counters.RATES) >= set(counters.AGENT_STATUS)
    assert not set(counters.EPISODE) & set(counters.RATES)
    assert {n: c.type for n, c in counters.EPISODE.items() if c.type is float} == {"turn_reward_sum": float}
    # api/ imports nothing of contract/: its AgentStatus must name and type the same counters.
    fields = AgentStatus.model_fields
    assert list(fields) == list(counters.AGENT_STATUS)
    for name in counters.AGENT_STATUS:
        kind = (counters.EPISODE.get(name) or counters.RATES[name]).type
        # whole-job totals are always there (0 before any); a mean is absent until one was measured
        assert fields[name].annotation == (int if kind is int else float | None), (name, fields[name].annotation)


def test_the_script_arguments_follow_the_name_not_the_value_type():
    # the int 0 of an empty sum still goes to HINCRBYFLOAT; an integral float to HINCRBY
    assert counters.script_args({"turn_reward_sum": 0, "turns": 3.0, "turn_rewards": 0}) == [
        "turn_reward_sum", "f", "0.0", "turns", "i", "3", "turn_rewards", "i", "0"]
    with pytest.raises(ValueError, match="'tool_cals' is no episode counter"):
        counters.script_args({"tool_cals": 1})
    with pytest.raises(ValueError, match="episode counter turns: 1.5 is no int"):
        counters.script_args({"turns": 1.5})
    with pytest.raises(ValueError, match="turn_reward_sum: nan is no float"):
        counters.script_args({"turn_reward_sum": math.nan})


def test_a_group_without_turn_rewards_sums_them_as_a_float():
    totals = counters.group_totals([EpisodeResult([1]).counts(), EpisodeResult([1], turns=2).counts()])
    assert totals["turn_reward_sum"] == 0.0 and isinstance(totals["turn_reward_sum"], float)
    assert totals["episodes"] == 2 and totals["turns"] == 2 and isinstance(totals["turns"], int)


# --- the property: groups with and without per-turn rewards, in any order, on a real Redis ---------------------

turn_reward = st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, allow_infinity=False)
episode = st.builds(
    lambda turns, calls, errors, truncated, drifted, rewards: EpisodeResult(
        [1, 2], tokens=[5] * turns, logprobs=[0.0] * turns, versions=[0] * turns, turns=turns, tool_calls=calls,
        tool_errors=errors, truncated=truncated, drifted=drifted, turn_rewards=rewards),
    st.integers(1, 4), st.integers(0, 3), st.integers(0, 1), st.booleans(), st.booleans(),
    st.one_of(st.just([]), st.lists(turn_reward, min_size=1, max_size=3)))
groups = st.lists(st.lists(episode, min_size=1, max_size=4), min_size=1, max_size=8)


def _write_all(url: str, results: list[list[EpisodeResult]]) -> None:
    """The actor's path: each group built and summed as Actor.episode_group/episode_totals do, then written by the
    lag counter's script (HINCRBY / HINCRBYFLOAT per counter)."""
    async def run() -> None:
        client = aioredis.Redis.from_url(url)
        try:
            lag = LagCounter(client, KEYS, max_lag=1000, samples_per_step=1)
            for episodes in results:
                actor = SimpleNamespace(name="actor-0", algo=SimpleNamespace(group_size=len(episodes)),
                                        environment=object())
                group = Actor.episode_group(actor, episodes)
                assert await lag.write(group, 0, Actor.episode_totals(actor, group)) is not None
        finally:
            await client.aclose()
    asyncio.run(run())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(results=groups)
def test_counters_of_groups_with_and_without_turn_rewards_in_any_order(redis_server, redis_client, results):
    redis_client.delete(KEYS.episodes, KEYS.rollouts, KEYS.actor_samples_written)
    _write_all(redis_server.url, results)  # never raises, whichever group comes first
    raw = {k.decode(): v.decode() for k, v in redis_client.hgetall(KEYS.episodes).items()}
    flat = [e for g in results for e in g]
    want_int = {"episodes": len(flat), "turns": sum(e.turns for e in flat),
                "tool_calls": sum(e.tool_calls for e in flat), "tool_errors": sum(e.tool_errors for e in flat),
                "truncated": sum(e.truncated for e in flat), "drifted": sum(e.drifted for e in flat),
                "turn_rewards": sum(len(e.turn_rewards) for e in flat)}
    for name, value in want_int.items():
        assert raw[name] == str(value), (name, raw)  # an integer field stays an integer (HINCRBY would work)
    rewards = [r for e in flat for r in e.turn_rewards]
    assert math.isclose(float(raw["turn_reward_sum"]), sum(rewards), abs_tol=1e-9)
    typed = counters.read_hash(redis_client.hgetall(KEYS.episodes))  # the trainer's reading
    assert all(type(typed[n]) is counters.EPISODE[n].type for n in typed)
    assert set(typed) == set(counters.EPISODE)
    # and another increment of either kind still lands on every field
    redis_client.hincrby(KEYS.episodes, "turns", 1)
    redis_client.hincrbyfloat(KEYS.episodes, "turn_reward_sum", 0.0)


# --- the status subset: one reading for the operator and `rlkube local` ------------------------------------------


def _metrics(step: int, **agent) -> dict:
    return {"step": step, "reward_mean": 0.5, "lag_max": 1,
            **{counters.METRIC_PREFIX + n: v for n, v in agent.items() if n in counters.EPISODE}, **{
                n: v for n, v in agent.items() if n in counters.RATES}}


def test_the_agent_status_is_read_by_type_and_rounded():
    facts = progress.read(event(datetime.now(timezone.utc), protocol.METRICS, **_metrics(
        3, episodes=96, turns=150, tool_calls=54.0, drifted=True, turn_rewards=20, turn_reward_mean=0.123456,
        tool_calls_per_episode=0.56)))
    # an integral float is an integer count; a bool is no count; raw sums and per-episode rates stay out
    assert facts.agent == {"episodes": 96, "turns": 150, "tool_calls": 54, "turn_reward_mean": 0.1235}
    assert type(facts.agent["tool_calls"]) is int
    single_turn = progress.read(event(datetime.now(timezone.utc), protocol.METRICS, step=3, reward_mean=0.5))
    assert single_turn.agent is None


json_value = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5),
                      st.lists(st.integers(), max_size=2))


@given(payload=st.dictionaries(st.sampled_from(
    [counters.METRIC_PREFIX + n for n in counters.EPISODE] + list(counters.RATES) + list(counters.EVALUATION)),
    json_value))
def test_any_payload_is_read_without_raising_and_only_as_the_counters_types(payload):
    for got in (counters.agent_status(payload) or {}, counters.evaluation_status(payload)):
        for name, value in got.items():
            counter = counters.EPISODE.get(name) or counters.RATES.get(name) or counters.EVALUATION[name]
            assert type(value) is counter.type and math.isfinite(value), (name, value)
            assert counter.type is float or -2**63 <= value < 2**63  # an int64, as the status field holds


def test_operator_and_local_show_the_same_agent_status(tmp_path):
    now = datetime.now(timezone.utc)
    t0 = now - timedelta(seconds=30)
    events = (event(t0, protocol.WEIGHTS_READY, step=0, version=0, documents_seen=0),
              event(t0 + timedelta(seconds=1), protocol.METRICS, **_metrics(
                  1, episodes=32, turns=40, tool_calls=8, turn_rewards=8, turn_reward_mean=0.05)),
              # a step whose episodes earned no per-turn reward: no turn_reward_mean, the last one stays
              event(t0 + timedelta(seconds=2), protocol.METRICS, **_metrics(
                  2, episodes=64, turns=72, tool_calls=8, tool_errors=1, truncated=2, turn_rewards=8)))
    raw = specs.spec()
    spec = parse_spec(raw)
    d = decide_running(raw, events, t0, now)
    want = {"episodes": 64, "turns": 72, "tool_calls": 8, "tool_errors": 1, "tool_timeouts": 0,
            "sandbox_refusals": 0, "truncated": 2, "timed_out": 0, "drifted": 0, "turn_reward_mean": 0.05}
    assert d.status.agent is not None and d.status.agent.model_dump() == want
    assert d.status.model_dump(by_alias=True, exclude_none=True)["agent"]["toolCalls"] == 8

    job = LocalJob("j", spec, raw, tmp_path, Console(file=open("/dev/null", "w")))
    for ev in events:
        job._ingest(ev)
    shown = {n: job.agent.get(n, 0 if n != "turn_reward_mean" else None) for n in counters.AGENT_STATUS}
    assert shown == want
    result = RunResult("j", "Running", "", "", 2, 40, job.metrics, [], [], 1.0, tmp_path, agent=job.agent)
    assert result.summary()["agent"] == job.agent
    # a single-turn job shows no agent counters in either
    plain = LocalJob("p", spec, raw, tmp_path, Console(file=open("/dev/null", "w")))
    plain._ingest(event(t0, protocol.METRICS, step=1, reward_mean=0.5))
    assert plain.agent is None
