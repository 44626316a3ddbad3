"""Evaluation while training (`spec.evaluation`): a fixed set of held-out prompts, scored by actor 0 every N weight
versions with fixed sampling settings, and never trained on.

Why here, in the actor: it has the inference servers, the prompt rendering and the task's reward, and it follows
the trainer's `weights_ready` events. Evaluation runs beside the workers in the actor's event loop, outside the lag
counters, and its samples go to no rollout: the trainer never waits for it and the preprocessor never sees it.
Its result is one `evaluation` event in the events stream (docs/design.md §5.2), which the launchers read into the
job's status, Prometheus and `rlkube local`'s summary (rlkube.lifecycle.progress). With `spec.samples` the first
`perStep` prompts' samples follow it on their own stream, for the trainer's samples.jsonl (docs/design.md §5.7).

Held out, never trained on:
- without `split`, a prompt is held out when a hash of its text (or messages) falls below `heldOutFraction`: the
  same split in every actor replica, restart and run, for generators and datasets alike. Every actor replica
  draws its training prompts through `TrainingPrompts`, which redraws a held-out prompt; the eval set is drawn from
  the held-out prompts only (distinct, from `seed`).
- with `split`, the eval set is that split of `spec.task.dataset`; the actor refuses to start (naming
  `spec.evaluation.split`) when any eval prompt is also in the training split.

When: the newest multiple of `everyVersions` a `weights_ready` crossed since the previous one (`due_version`),
version 0 included, each version once in the job (a Redis set claims it, so a restarted actor does not score it
again). On training_finished the actor's workers stop but it exits only once the versions already due are scored
(the final one too: its weights_ready comes first), unless a signal stops it first. The eval requests ask for at least
that version (`min_model_version`) and report the versions that sampled them: with a pipelined trainer the servers may
already hold newer weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import protocol
from rlkube.contract import samples as sample_rows
from rlkube.core.actor.episodes import SampleRefused, call_with_timeout, draws_own_prompts, run_episode
from rlkube.core.actor.tasks import Scorer, load_task
from rlkube.core.actor.task_types import Prompt, TaskError

log = logging.getLogger("rlkube.evaluation")

DEFAULT_HELD_OUT_FRACTION = 0.1
MAX_DRAWS = 200
"""Training redraws at most this many held-out prompts in a row; the eval set's draw stops after this many draws
per eval prompt."""
CONCURRENT_REQUESTS = 4
UNIFORM_TRIES = 3
"""A set sampled by more than one weight version (an update landed mid-evaluation) is scored again, whole, with the
newest of them, up to this many times in all: one eval, one set of weights, as far as the servers allow."""


def prompt_key(prompt: Prompt) -> str:
    """What makes two prompts the same prompt: the chat messages when it has them, else its text."""
    if prompt.messages is not None:
        return json.dumps([dict(m) for m in prompt.messages], sort_keys=True, ensure_ascii=False, default=str)
    return prompt.text


def held_out(prompt: Prompt, fraction: float) -> bool:
    """Whether the prompt belongs to the eval set's side of the hash split (stable across processes, unlike
    Python's salted hash())."""
    digest = hashlib.blake2b(prompt_key(prompt).encode(), digest_size=8, person=b"rlkube-eval").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def held_out_fraction(spec: TrainingJobSpec) -> float | None:
    """The hash split's fraction; None without evaluation or with a dataset split (which holds out by itself)."""
    ev = spec.evaluation
    if ev is None or ev.split is not None:
        return None
    return ev.held_out_fraction if ev.held_out_fraction is not None else DEFAULT_HELD_OUT_FRACTION


def due_version(last: int | None, version: int, every: int) -> int | None:
    """The version to evaluate on seeing weights `version` after `last` (None: the first one this actor saw): the
    newest multiple of `every` in (last, version], or on a first sight `version` itself when it is a multiple (a
    restarted actor does not label newer weights with an older version). None: nothing is due."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if last is None:
        return version if version % every == 0 else None
    newest = version - version % every
    return newest if newest > last else None


class TrainingPrompts:
    """A task (or an environment that draws its own prompts) whose `prompt` never returns a held-out prompt;
    everything else is the wrapped object's."""

    def __init__(self, source: Any, fraction: float):
        self._source = source
        self._fraction = fraction

    def prompt(self, rng: random.Random) -> Prompt:
        for _ in range(MAX_DRAWS):
            p = self._source.prompt(rng)
            if not held_out(p, self._fraction):
                return p
        raise TaskError("spec.evaluation.heldOutFraction", f"{MAX_DRAWS} prompts in a row drawn for training were "
                        f"all held out for evaluation (fraction {self._fraction}): lower it")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def __repr__(self) -> str:
        return f"{self._source!r} without the held-out {self._fraction:g}"


def eval_prompts(spec: TrainingJobSpec, source: Any) -> list[Prompt]:
    """The job's eval set. `source`: a fresh task (or the environment) drawing prompts, used for the hash split.
    Raises TaskError naming the spec.evaluation field."""
    ev = spec.evaluation
    assert ev is not None
    if ev.split is not None:
        return split_prompts(spec)
    fraction = held_out_fraction(spec)
    assert fraction is not None
    rng = random.Random(ev.seed)
    chosen: dict[str, Prompt] = {}
    for _ in range(MAX_DRAWS * ev.prompts):
        p = source.prompt(rng)
        if held_out(p, fraction):
            chosen.setdefault(prompt_key(p), p)
            if len(chosen) == ev.prompts:
                break
    if not chosen:
        raise TaskError("spec.evaluation.heldOutFraction", f"no prompt of the task fell in the held-out "
                        f"{fraction:g} in {MAX_DRAWS * ev.prompts} draws: raise it")
    if len(chosen) < ev.prompts:
        log.warning("evaluation: only %d distinct held-out prompts found (spec.evaluation.prompts is %d)",
                    len(chosen), ev.prompts)
    return list(chosen.values())


def split_prompts(spec: TrainingJobSpec) -> list[Prompt]:
    """The first `prompts` rows of spec.evaluation.split of the training dataset, after checking that none of them
    is a prompt of the training split."""
    from rlkube.core.actor.prompt_dataset import DatasetTask  # numpy and datasets: only dataset tasks pay for them

    ev, ds = spec.evaluation, spec.task.dataset
    assert ev is not None and ev.split is not None and ds is not None
    try:
        held = DatasetTask.load(spec.task.name, ds.model_copy(update={"split": ev.split, "shuffle": False}))
    except TaskError as exc:
        if exc.field.endswith(".split") or exc.field.endswith(".path"):
            raise TaskError("spec.evaluation.split", f"{ev.split!r} of {ds.path}: {exc.message}") from None
        raise
    prompts = [held.prompt() for _ in range(min(ev.prompts, len(held)))]
    train = DatasetTask.load(spec.task.name, ds.model_copy(update={"shuffle": False}))
    training = {prompt_key(train.prompt()) for _ in range(len(train))}
    both = [p for p in prompts if prompt_key(p) in training]
    if both:
        raise TaskError("spec.evaluation.split", f"{len(both)} of its {len(prompts)} eval prompts are also in the "
                        f"training split {ds.split or 'train'!r} of {ds.path} (e.g. {both[0].text[:100]!r}): "
                        "evaluation must score prompts the policy never trained on")
    return prompts


def build_eval_set(spec: TrainingJobSpec, environment: Any) -> list[Prompt]:
    """The eval set the way the actor draws prompts: the environment's own, else a fresh copy of the task (a
    dataset task's row order is its own: the training task's must not be advanced)."""
    return eval_prompts(spec, environment if draws_own_prompts(environment) else load_task(spec.task))


@dataclass
class EvalOutcome:
    reward: float
    failed: bool
    versions: list[int]
    row: dict[str, Any] | None = None  # the prompt's sample row (rlkube.contract.samples), for spec.samples


class Evaluator:
    """Actor 0's evaluation loop. `actor` is the rlkube.core.actor.role.Actor it runs in (its requests, rendering,
    tokenizer, environment and Redis); `refused` the error its requests raise for a prompt a server refuses,
    `stopped` the one they raise when the actor stops (the actor's own classes, handed over: the actor imports
    this module)."""

    def __init__(self, actor: Any, spec: TrainingJobSpec, prompts: list[Prompt], refused: type[Exception],
                 stopped: type[Exception]):
        ev = spec.evaluation
        assert ev is not None
        self.actor = actor
        self.refused, self.stopped = refused, stopped
        self.every = ev.every_versions
        self.temperature = ev.temperature
        self.max_new_tokens = ev.max_new_tokens or spec.algorithm.max_new_tokens
        self.seed = ev.seed
        self.prompts = prompts
        self.score = Scorer(actor.task)
        self.last: int | None = None
        self.queue: asyncio.Queue[int] = asyncio.Queue()
        self.reported: list[int] = []
        # spec.samples: the first perStep prompts' samples of each evaluated version go to the trainer's file
        self.keep = spec.samples.per_step if spec.samples.every_steps > 0 else 0
        self.rows: list[dict[str, Any]] = []  # the last evaluation's

    def on_version(self, version: int) -> None:
        """A weights_ready announced `version` (rlkube.core.actor calls this for each, in stream order)."""
        if self.last is not None and version < self.last:
            self.last = None  # a restarted trainer resumed lower: start over as on a first sight
        due = due_version(self.last, version, self.every)
        self.last = version
        if due is not None:
            self.queue.put_nowait(due)

    async def run(self, session: Any) -> None:
        """Evaluate each due version in turn until the actor stops."""
        with contextlib.suppress(self.stopped):
            await self._loop(session)

    async def _loop(self, session: Any) -> None:
        keys, redis = self.actor.keys, self.actor.redis
        while True:
            # The actor's run waits for every worker, this loop included, to return. After training_finished
            # (actor.stop) the versions already due are still scored (the final one too, when its weights_ready
            # came first), while inference still serves; a signal (actor.halt) ends it at once.
            if self.queue.empty():
                if self.actor.stop.is_set():
                    return
                with contextlib.suppress(self.stopped):
                    await self.actor.until_stopped(self._next())
                continue
            version = self.queue.get_nowait()
            if not await redis.sadd(keys.evaluated, version):
                continue  # scored already (this actor before a restart)
            reported = False
            try:
                event = await self.evaluate(session, version)
                await redis.xadd(keys.events, protocol.encode_event(protocol.EVALUATION, **event))
                reported = True
                # After the event: a reader of the samples never sees rows of an unreported version. Sent even
                # with no rows (every kept prompt skipped): the finished trainer waits for this version's entry.
                if self.keep:
                    await redis.xadd(keys.evaluation_samples, {sample_rows.EVALUATION_FIELD: json.dumps(
                        {"version": version, "rows": self.rows}, ensure_ascii=False)}, maxlen=10_000,
                        approximate=True)
                self.reported.append(version)
                log.info("evaluation of version %d: reward %s over %d prompts (sampled by versions %s-%s, %d "
                         "attempts) in %.1fs", version, event["reward_mean"], event["prompts"],
                         event["model_version"], event["model_version_max"], event["attempts"], event["seconds"])
            finally:
                if not reported:  # stopped first: leave the version to whoever runs next
                    with contextlib.suppress(Exception):
                        await asyncio.shield(redis.srem(keys.evaluated, version))

    async def _next(self) -> None:
        """Until a version is due (the queue holds it)."""
        version = await self.queue.get()
        self.queue.put_nowait(version)  # back in order: nothing else takes from the queue
        # (asyncio.Queue has no peek; a single consumer may put back what it took)

    async def evaluate(self, session: Any, version: int) -> dict[str, Any]:
        """Score every eval prompt with weights of at least `version` (all with the same weights where
        UNIFORM_TRIES allows); the `evaluation` event's payload. Raises the actor's Stopped when it stops first."""
        t0 = time.monotonic()
        limit = asyncio.Semaphore(CONCURRENT_REQUESTS)

        async def one(i: int, prompt: Prompt, at: int) -> EvalOutcome | None:
            async with limit:
                return await self.one(session, at, i, prompt)

        at = version
        for attempt in range(1, UNIFORM_TRIES + 1):
            outcomes = await asyncio.gather(*(one(i, p, at) for i, p in enumerate(self.prompts)))
            scored = [o for o in outcomes if o is not None and o.versions]
            versions = [v for o in scored for v in o.versions]
            if not versions or min(versions) == max(versions):
                break
            at = max(versions)
        self.rows = [{**o.row, "version": version, "step": version}
                     for o in outcomes[:self.keep] if o is not None and o.row is not None]
        return {
            "version": version,
            "reward_mean": sum(o.reward for o in scored) / len(scored) if scored else None,
            "prompts": len(scored),
            "skipped": len(self.prompts) - len(scored),
            "reward_errors": sum(o.failed for o in scored),
            "model_version": min(versions) if versions else None,
            "model_version_max": max(versions) if versions else None,
            "attempts": attempt,
            "temperature": self.temperature,
            "seconds": round(time.monotonic() - t0, 3),
            "actor": self.actor.name,
        }

    def _row(self, prompt: Prompt, completion: str, turns: list[dict[str, Any]], reward: float, failed: bool,
             sampled: int, finish: str, episode: dict[str, Any] | None = None) -> dict[str, Any]:
        """One eval prompt's sample row (rlkube.contract.samples); `version`/`step` are set by evaluate."""
        row: dict[str, Any] = {
            "kind": sample_rows.EVALUATION, "weight_version": sampled, "prompt": prompt.text,
            "prompt_key": prompt_key(prompt), "completion": completion, "turns": turns, "reward": float(reward),
            "finish_reason": finish, "time": sample_rows.now()}
        if episode is not None:
            row["episode"] = episode
        if failed:
            row["reward_error"] = True
        return row

    async def one(self, session: Any, version: int, i: int, prompt: Prompt) -> EvalOutcome | None:
        """One prompt's reward (one completion, or one episode); None when a server refuses the prompt or the
        environment cannot start an episode."""
        actor = self.actor
        seed = random.Random(f"{self.seed}/{i}").getrandbits(62)  # the same for every version: fixed sampling
        rendered = actor.render(prompt)

        def version_of(reply: dict) -> int:
            v = reply.get("model_version")
            return int(v) if isinstance(v, int) else version

        try:
            if actor.environment is None:
                reply = await actor.request(session, rendered, version, n=1, max_tokens=self.max_new_tokens,
                                            temperature=self.temperature, seed=seed, stop=actor.halt)
                choice = reply["choices"][0]
                reward, failed = self.score(prompt, choice["text"])
                row = None
                if i < self.keep:
                    row = self._row(prompt, choice["text"], [{"role": "model", "text": choice["text"],
                                                              "tokens": len(choice.get("token_ids") or ()),
                                                              "masked": False}],
                                    reward, failed, version_of(reply),
                                    sample_rows.finish_reason(choice.get("finish_reason") == "stop"))
                return EvalOutcome(reward, failed, [version_of(reply)], row)
            try:
                episode = await call_with_timeout(actor.environment.start, prompt,
                                                  timeout=actor.limits.tool_timeout_s)
            except self.stopped:
                raise
            except Exception as exc:  # noqa: BLE001 - the environment's code (ToolTimeout included)
                log.error("evaluation: the environment could not start an episode from %r: %s: %s; skipping it",
                          prompt.text[:200], type(exc).__name__, exc)
                return None
            first = await actor.request(session, rendered, version, n=1, max_tokens=self.max_new_tokens,
                                        temperature=self.temperature, seed=seed, stop=actor.halt)

            async def sample(ids: list[int], max_tokens: int) -> Any:
                try:
                    reply = await actor.request(session, ids, version, n=1, max_tokens=max_tokens,
                                                temperature=self.temperature, seed=seed, stop=actor.halt)
                except self.refused as exc:
                    raise SampleRefused(str(exc)) from None
                return actor._reply(reply["choices"][0], version_of(reply))

            result = await run_episode(episode, actor._reply(first["choices"][0], version_of(first)), sample,
                                       actor.encoder, actor.tokenizer.decode, actor.limits, self.max_new_tokens)
            row = None
            if i < self.keep:
                decode = (lambda ids: actor.tokenizer.hf.decode(ids, skip_special_tokens=False))
                counts = {"turns": result.turns, "tool_calls": result.tool_calls, "tool_errors": result.tool_errors,
                          "tool_timeouts": result.tool_timeouts, "truncated": int(result.truncated),
                          "timed_out": int(result.timed_out)}
                row = self._row(prompt, decode(result.tokens), sample_rows.turns(result.tokens, result.env_spans,
                                                                                  decode),
                                result.reward, result.reward_error, min(result.versions, default=version),
                                sample_rows.finish_reason(result.finished, counts), episode=counts)
            return EvalOutcome(result.reward, result.reward_error, sorted(set(result.versions)), row)
        except self.refused as exc:
            log.error("evaluation: %s; skipping it", exc)
            return None
