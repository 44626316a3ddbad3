"""spec.evaluation's pure parts (rlkube.core.actor.evaluation, validation, the event's reading): when a version is due,
the hash split that keeps eval prompts out of training, the eval set, a dataset split that overlaps training refused
naming the field, bad input refused naming the field, and both launchers reading an `evaluation` event alike (eval
reward into the status and `rlkube local`'s summary, never as a sign of trainer life).

The real run (a tiny job whose eval reward is reported at the exact versions and whose training documents hold no
eval prompt) is tests/integration/local/test_local_evaluation.py."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import datetime, timedelta, timezone

import pytest
from support import specs
from rich.console import Console
from support.trainer_events import decide_running, event

from rlkube.api.spec import TrainingJobSpec
from rlkube.api.status import TrainingJobStatus
from rlkube.contract import protocol
from rlkube.core.actor import evaluation
from rlkube.core.actor.evaluation import Evaluator, TrainingPrompts, due_version, eval_prompts, held_out, prompt_key
from rlkube.core.actor.tasks import load_task
from rlkube.core.actor.task_types import Prompt, TaskError
from rlkube.lifecycle import progress
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.local.runner import LocalJob, RunResult


def spec_with(**evaluation_fields) -> TrainingJobSpec:
    return parse_spec(specs.spec(**{"evaluation": {"everyVersions": 4, **evaluation_fields}}))


# -- when ------------------------------------------------------------------------------------------------------


def test_due_versions_are_the_multiples_crossed():
    seen, due, last = list(range(13)), [], None
    for v in seen:
        if (d := due_version(last, v, 4)) is not None:
            due.append(d)
        last = v
    assert due == [0, 4, 8, 12]


def test_a_jump_over_a_multiple_evaluates_it_once_and_a_first_sight_only_at_a_multiple():
    assert due_version(3, 5, 4) == 4  # crossed 4: labelled 4, sampled with >= 4 (the event says which)
    assert due_version(4, 5, 4) is None
    assert due_version(1, 9, 4) == 8  # two multiples crossed: only the newest
    assert due_version(None, 7, 4) is None  # a restarted actor does not call version 7's weights "version 4"
    assert due_version(None, 8, 4) == 8
    with pytest.raises(ValueError):
        due_version(None, 0, 0)


class _Actor:
    task = load_task(parse_spec(specs.spec()).task)


def test_the_evaluator_queues_each_due_version_and_starts_over_after_a_trainer_restart():
    ev = Evaluator(_Actor(), spec_with(), [Prompt("1:", {"answer": "1"})], refused=RuntimeError, stopped=KeyError)
    for v in (0, 1, 2, 3, 4, 5, 8, 9, 3, 4, 7, 12):  # a restarted trainer resumed at 3
        ev.on_version(v)
    got = []
    while not ev.queue.empty():
        got.append(ev.queue.get_nowait())
    assert got == [0, 4, 8, 4, 12]  # 4 again: the Redis claim (actor/evaluated) skips what was scored


# -- held out, never trained on ----------------------------------------------------------------------------------


def test_the_split_is_a_stable_hash_of_the_prompt():
    task = load_task(parse_spec(specs.spec()).task)
    rng = random.Random(1)
    prompts = {prompt_key(p): p for p in (task.prompt(rng) for _ in range(3000))}
    held = [k for k, p in prompts.items() if held_out(p, 0.1)]
    assert 0.03 * len(prompts) < len(held) < 0.2 * len(prompts)  # 110 prompts: about 11 held out
    assert held == [k for k, p in prompts.items() if held_out(p, 0.1)]
    # Another fraction keeps what a smaller one held out (the split only grows).
    assert set(held) <= {k for k, p in prompts.items() if held_out(p, 0.3)}
    # Messages and text are different prompts; the same messages are the same prompt.
    chat = [{"role": "user", "content": "1:"}]
    assert prompt_key(Prompt("1:", messages=chat)) == prompt_key(Prompt("other text", messages=list(chat)))
    assert prompt_key(Prompt("1:", messages=chat)) != prompt_key(Prompt("1:"))


def test_training_never_draws_a_held_out_prompt_and_the_eval_set_is_held_out_and_distinct():
    spec = spec_with(prompts=8)
    task = load_task(spec.task)
    rng = random.Random(0)
    raw = [task.prompt(rng) for _ in range(2000)]
    assert any(held_out(p, 0.1) for p in raw)  # the task itself draws them: the wrapper is what keeps them out
    training = TrainingPrompts(load_task(spec.task), 0.1)
    drawn = {prompt_key(training.prompt(rng)) for _ in range(2000)}
    eval_set = eval_prompts(spec, load_task(spec.task))
    assert len(eval_set) == 8 and len({prompt_key(p) for p in eval_set}) == 8
    assert all(held_out(p, 0.1) for p in eval_set)
    assert not drawn & {prompt_key(p) for p in eval_set}
    assert training.name == task.name and training.raw_prompts  # the rest is the task's
    # Fixed by the seed: the same set every time, another with another seed.
    assert [p.text for p in eval_prompts(spec, load_task(spec.task))] == [p.text for p in eval_set]
    assert [p.text for p in eval_prompts(spec_with(prompts=8, seed=1), load_task(spec.task))] != [
        p.text for p in eval_set]


def test_a_small_prompt_space_gives_the_held_out_prompts_it_has():
    spec = parse_spec(specs.spec(**{"task.name": "repeat-digit", "evaluation": {"everyVersions": 1,
                                                                                 "heldOutFraction": 0.5}}))
    got = eval_prompts(spec, load_task(spec.task))
    assert 1 <= len(got) < 10 and all(held_out(p, 0.5) for p in got)


def test_a_fraction_that_holds_out_everything_or_nothing_is_refused_naming_the_field():
    class Always:
        name = "one"

        def prompt(self, rng):
            return Prompt("always the same")

    fraction = 0.5
    inside = held_out(Prompt("always the same"), fraction)
    if inside:
        with pytest.raises(TaskError) as err:
            TrainingPrompts(Always(), fraction).prompt(random.Random(0))
    else:
        with pytest.raises(TaskError) as err:
            eval_prompts(spec_with(heldOutFraction=fraction, prompts=1), Always())
    assert err.value.field == "spec.evaluation.heldOutFraction"


def _jsonl(path, rows):
    path.write_text("".join(json.dumps({"prompt": r, "answer": r[::-1]}) + "\n" for r in rows))


def _split_spec(path, train: str, held: str) -> TrainingJobSpec:
    return parse_spec(specs.spec(**{"task.dataset": {"path": str(path), "split": train, "shuffle": False},
                                    "task.reward": {"type": "exact"},
                                    "evaluation": {"everyVersions": 2, "split": held, "prompts": 4}}))


def test_a_dataset_split_is_the_eval_set_and_one_that_overlaps_training_is_refused(tmp_path):
    path = tmp_path / "rows.jsonl"
    _jsonl(path, [f"{i:02d}:" for i in range(20)])
    got = evaluation.split_prompts(_split_spec(path, "train[:10]", "train[10:]"))
    assert [p.text for p in got] == ["10:", "11:", "12:", "13:"]
    with pytest.raises(TaskError) as err:
        evaluation.split_prompts(_split_spec(path, "train[:10]", "train[8:]"))
    assert err.value.field == "spec.evaluation.split"
    assert "2 of its 4 eval prompts are also in the training split" in str(err.value)
    with pytest.raises(TaskError) as err:
        evaluation.split_prompts(_split_spec(path, "train[:10]", "test"))
    assert err.value.field == "spec.evaluation.split"


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, field", [
    ({"everyVersions": 0}, "spec.evaluation.everyVersions"),
    ({"everyVersions": 2, "prompts": 0}, "spec.evaluation.prompts"),
    ({"everyVersions": 2, "heldOutFraction": 1}, "spec.evaluation.heldOutFraction"),
    ({"everyVersions": 2, "temperature": -1}, "spec.evaluation.temperature"),
    ({"everyVersions": 2, "split": "test"}, "spec.evaluation.split"),  # no spec.task.dataset
    ({}, "spec.evaluation.everyVersions"),
])
def test_bad_evaluation_input_is_refused_naming_the_field(fields, field):
    with pytest.raises(SpecError) as err:
        parse_spec(specs.spec(evaluation=fields))
    assert field in [e.field for e in err.value.errors], str(err.value)


def test_a_split_with_a_held_out_fraction_and_a_dataset_without_reward_are_refused():
    ds = {"path": "/data/x.jsonl"}
    with pytest.raises(SpecError) as err:
        parse_spec(specs.spec(**{"task.dataset": ds, "task.reward": {"type": "exact"},
                                 "evaluation": {"everyVersions": 2, "split": "test", "heldOutFraction": 0.2}}))
    assert [e.field for e in err.value.errors] == ["spec.evaluation.heldOutFraction"]
    with pytest.raises(SpecError) as err:
        parse_spec(specs.spec(**{"task.dataset": {**ds, "completionField": "c"}, "algorithm.loss": "sft",
                                 "algorithm.groupSize": 1, "evaluation": {"everyVersions": 2}}))
    assert "spec.evaluation" in [e.field for e in err.value.errors]


# -- reading an evaluation event: one rule for both launchers ------------------------------------------------------


def test_an_evaluation_is_read_as_eval_reward_and_not_as_trainer_life():
    facts = progress.read(event(datetime.now(timezone.utc), protocol.EVALUATION, version=8, reward_mean=0.123456))
    assert facts.evaluation == (8, 0.1235) and not facts.from_trainer and facts.step is None
    assert progress.read(event(datetime.now(timezone.utc), protocol.EVALUATION, version="x",
                                reward_mean=1.0)).evaluation is None
    assert progress.read(event(datetime.now(timezone.utc), protocol.METRICS, step=1)).from_trainer


def test_operator_and_local_read_evaluations_alike(tmp_path):
    now = datetime.now(timezone.utc)
    t0 = now - timedelta(seconds=30)
    events = (event(t0, protocol.WEIGHTS_READY, step=0, version=0, documents_seen=0),
              event(t0 + timedelta(seconds=1), protocol.EVALUATION, version=0, reward_mean=0.0625),
              event(t0 + timedelta(seconds=2), protocol.METRICS, step=4, reward_mean=0.2),
              event(t0 + timedelta(seconds=3), protocol.EVALUATION, version=4, reward_mean=0.25, prompts=30,
                     skipped=2, reward_errors=1, attempts=1, seconds=3.5))
    raw = specs.spec(**{"evaluation": {"everyVersions": 4}})
    spec = parse_spec(raw)
    d = decide_running(raw, events, t0, now)
    tr = d.status.trainer
    assert (tr.eval_version, tr.eval_reward_mean) == (4, 0.25)
    assert (tr.eval_prompts, tr.eval_skipped, tr.eval_reward_errors) == (30, 2, 1)
    assert tr.last_event_id == events[-1].stream_id

    job = LocalJob("j", spec, raw, tmp_path, Console(file=open("/dev/null", "w")))
    for i, ev in enumerate(events):
        before = job.last_event_at
        job._ingest(ev)
        if ev.type == protocol.EVALUATION:
            assert job.last_event_at == before  # the stall clock runs on trainer events only
    assert [(e["version"], e["reward_mean"]) for e in job.evaluations] == [(0, 0.0625), (4, 0.25)]
    result = RunResult("j", "Running", "", "", 4, 40, job.metrics, [], [], 1.0, tmp_path,
                       evaluations=job.evaluations)
    s = result.summary()
    assert s["eval_versions"] == [0, 4] and s["eval_reward_first"] == 0.0625
    assert s["eval_reward_last"] == tr.eval_reward_mean
    # the same counts as the status, by the same rule (rlkube.contract.counters.evaluation_status)
    assert s["eval_last"] == {"reward_mean": tr.eval_reward_mean, "prompts": tr.eval_prompts,
                              "skipped": tr.eval_skipped, "reward_errors": tr.eval_reward_errors}


def test_the_evaluator_reports_each_version_once_through_redis(redis_client):
    """Evaluator.run against a real Redis with a stand-in for the actor's HTTP request: one `evaluation` event
    per due version, a version already claimed is skipped, a set that two weight versions sampled is scored again
    with the newer, and the payload says which weights sampled it. After training_finished (actor.stop) the
    versions already due are still scored, then the loop returns (the actor waits for every worker before it
    exits); a signal (actor.halt) ends it at once, leaving the version it was on unclaimed."""
    keys = protocol.StreamKeys.for_job("ns", "eval-unit")
    redis_client.delete(*keys.all())
    import redis.asyncio as aioredis

    from rlkube.core.actor.inference_client import BadPrompt, Stopped
    from rlkube.core.actor.role import Actor as RoleActor

    class Actor:
        task = load_task(parse_spec(specs.spec()).task)
        environment = None
        name = "actor-0"
        until_stopped = RoleActor.until_stopped  # the actor's own: Stopped once `stop` is set

        def __init__(self, client):
            self.keys, self.redis, self.asked = keys, client, []
            self.stop, self.halt = asyncio.Event(), asyncio.Event()
            self.hold = asyncio.Event()  # set: requests wait until halted (a server that is slow to answer)

        def render(self, prompt):
            return prompt.text

        async def request(self, session, prompt, min_version, n, max_tokens, temperature, seed, stop):
            if self.hold.is_set():
                await self.until_stopped(asyncio.Event().wait(), stop)
            self.asked.append((prompt, min_version, temperature, seed))
            answer = prompt[:-1][::-1]  # right answers: reward 1
            # Version 8's first attempt: an update to 9 lands after the first request.
            served = 9 if min_version == 8 and len([a for a in self.asked if a[1] == 8]) > 1 else min_version
            return {"model_version": served, "choices": [{"text": answer}]}

    async def main():
        client = aioredis.Redis(connection_pool=aioredis.ConnectionPool(**redis_client.connection_pool.connection_kwargs))
        actor = Actor(client)
        prompts = eval_prompts(spec_with(prompts=3), load_task(parse_spec(specs.spec()).task))
        ev = Evaluator(actor, spec_with(prompts=3, temperature=0), prompts, refused=BadPrompt, stopped=Stopped)
        await client.sadd(keys.evaluated, 4)  # claimed before (a restarted actor)
        run = asyncio.create_task(ev.run(None))
        for v in range(10):
            ev.on_version(v)

        async def two_reported():
            while len(ev.reported) < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(two_reported(), timeout=30)
        assert not run.done()  # waiting for the next due version
        ev.on_version(12)
        actor.stop.set()  # training_finished right after version 12's weights_ready
        await asyncio.wait_for(run, timeout=10)  # returns, not cancelled, after scoring 12
        assert ev.reported == [0, 8, 12]
        # A signal while a version is being scored: it ends at once, the version not reported and unclaimed.
        actor.stop.clear()
        actor.hold.set()
        run = asyncio.create_task(ev.run(None))
        ev.on_version(16)

        async def claimed():
            while not await client.sismember(keys.evaluated, 16):
                await asyncio.sleep(0.01)

        await asyncio.wait_for(claimed(), timeout=10)
        actor.halt.set()
        actor.stop.set()
        await asyncio.wait_for(run, timeout=10)
        assert ev.reported == [0, 8, 12] and not await client.sismember(keys.evaluated, 16)
        await client.aclose()
        return actor

    actor = asyncio.run(main())
    got = [protocol.decode_event(i, f) for i, f in redis_client.xrange(keys.events)]
    assert [(e.type, e.payload["version"]) for e in got] == [("evaluation", 0), ("evaluation", 8), ("evaluation", 12)]
    assert got[0].payload["reward_mean"] == 1.0 and got[0].payload["prompts"] == 3
    assert (got[0].payload["model_version"], got[0].payload["model_version_max"], got[0].payload["attempts"]) == (
        0, 0, 1)
    assert (got[1].payload["model_version"], got[1].payload["model_version_max"], got[1].payload["attempts"]) == (
        9, 9, 2)
    assert got[1].payload["temperature"] == 0
    # Every evaluation counter is in the payload as its type (rlkube.contract.counters.EVALUATION), through JSON.
    from rlkube.contract import counters
    for e in got:
        assert {n: type(e.payload[n]) for n in counters.EVALUATION} == {
            n: c.type for n, c in counters.EVALUATION.items()}, e.payload
    # Fixed sampling: the same seed for a prompt at every version, and at least the version evaluated.
    by_prompt = {}
    for prompt, min_version, temperature, seed in actor.asked:
        by_prompt.setdefault(prompt, set()).add(seed)
        assert min_version in (0, 8, 9, 12) and temperature == 0
    assert all(len(seeds) == 1 for seeds in by_prompt.values())
    redis_client.delete(*keys.all())


def test_prometheus_exposes_the_eval_reward_from_the_status_and_nothing_before_one():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from rlkube.controller.reconcile.jobmetrics import PREFIX, JobStatusCollector

    def scrape(status: TrainingJobStatus) -> dict[str, float]:
        c = JobStatusCollector(clock=lambda: 0.0)
        c.observe("ns", "j", status)
        registry = CollectorRegistry()
        registry.register(c)
        return {s.name: s.value for f in text_string_to_metric_families(generate_latest(registry).decode())
                for s in f.samples if s.labels.get("trainingjob") == "j"}

    got = scrape(TrainingJobStatus.model_validate(
        {"phase": "Running", "trainer": {"step": 9, "evalRewardMean": 0.40625, "evalVersion": 8, "evalPrompts": 32,
                                         "evalSkipped": 1, "evalRewardErrors": 3}}))
    assert got[PREFIX + "eval_reward_mean"] == 0.40625 and got[PREFIX + "eval_version"] == 8
    counts = (got[PREFIX + "eval_prompts"], got[PREFIX + "eval_skipped"], got[PREFIX + "eval_reward_errors"])
    assert counts == (32, 1, 3)
    none = scrape(TrainingJobStatus.model_validate({"phase": "Running", "trainer": {"step": 9}}))
    for name in ("eval_reward_mean", "eval_version", "eval_prompts", "eval_skipped", "eval_reward_errors"):
        assert PREFIX + name not in none, name
