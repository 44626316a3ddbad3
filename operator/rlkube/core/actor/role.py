"""The actor role (`python -m rlkube.core.actor`): samples rollout groups from inference and scores them.

Why its own role: sampling and scoring scale apart from training, any number of replicas (RLKUBE_INDEX) sharing the
lag counters in Redis (docs/design.md §7). The steps are named: `build_actor` (task, environment, tokenizer,
rendering, eval set), `Actor.run` (events -> inference health -> workers -> report). The Actor holds the state and
follows the trainer's events; its jobs are mixins of their own modules: the inference client
(rlkube.core.actor.inference_client), the sampling modes (rlkube.core.actor.sampling_modes) and the worker loop
(rlkube.core.actor.worker_loop). It stops on `training_finished`, never by counting samples (docs/references.md
§6.1); a stop interrupts every wait, never a Redis write.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp
import redis.asyncio as aioredis

from rlkube.contract import protocol, runtime, streams
from rlkube.core import errors
from rlkube.contract.context import RoleContext
from rlkube.core.hf.loading import load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.actor.lag import LagCounter, documents_seen_of
from rlkube.core.hf.tokenizer import Tokenizer
from rlkube.core.actor.episodes import Environment, Limits, MessageEncoder, draws_own_prompts
from rlkube.core.actor.environments import limits as episode_limits
from rlkube.core.actor.environments import load_environment
from rlkube.core.actor.evaluation import Evaluator, TrainingPrompts, build_eval_set, held_out_fraction
from rlkube.core.actor.inference_client import BadPrompt, InferenceClient, Stopped
from rlkube.core.actor.sampling_modes import SamplingModes, supervised
from rlkube.core.actor.tasks import JobTask, Prompt, Scorer, load_task, prompt_renderer
from rlkube.core.actor.worker_loop import WorkerLoop

log = logging.getLogger("rlkube.actor")
T = TypeVar("T")

ENV_STALL_SECONDS = "RLKUBE_ACTOR_STALL_SECONDS"  # optional: holding this long without progress frees credit
DEFAULT_STALL_S = 30.0


@dataclass
class TrainerView:
    """What the actor knows about the trainer, from its events."""

    version: int | None = None  # None until the first weights_ready
    documents_seen: int = 0
    finished: bool = False
    last_event_at: float = 0.0


class Actor(WorkerLoop, SamplingModes, InferenceClient):
    """One replica's state, its stop and the trainer's events it follows; the jobs come from the mixins."""

    def __init__(self, ctx: RoleContext, client: aioredis.Redis, task: JobTask,
                 stall_s: float = DEFAULT_STALL_S, render: Callable[[Prompt], str | list[int]] | None = None,
                 tokenizer: Tokenizer | None = None, environment: Environment | None = None,
                 encoder: MessageEncoder | None = None, eval_set: list[Prompt] | None = None):
        self.supervised = supervised(ctx.spec)
        if self.supervised and tokenizer is None:
            raise ValueError("the supervised (sft) actor needs the model's tokenizer")
        if not ctx.inference_urls and not self.supervised:
            raise SystemExit(f"{runtime.ENV_INFERENCE_URLS} is not set: the actor needs the inference servers")
        self.tokenizer = tokenizer
        self.group_n = 1 if self.supervised else ctx.spec.algorithm.group_size  # samples per reservation
        self.ctx = ctx
        self.spec = ctx.spec
        self.algo = ctx.spec.algorithm
        self.redis = client
        self.keys = ctx.keys
        self.task = task
        self.render = render or prompt_renderer(ctx.spec.task, task)  # no tokenizer: plain-text prompts
        self.score = Scorer(task)
        self.scores = task.reward is not None  # a supervised dataset may come without a reward
        self.name = f"actor-{ctx.index}"
        self.urls = [u.rstrip("/") for u in ctx.inference_urls]
        self.stall_s = stall_s
        self.inflight = 0  # samples reserved by this replica's workers and not yet written or given back
        self.lag = LagCounter(client, self.keys, self.algo.max_lag, self.algo.samples_per_step)
        self.view = TrainerView()
        self.changed = asyncio.Event()  # set on every weights_ready / training_finished
        self.stop = asyncio.Event()
        # Set by a signal or a failure only, not by training_finished: evaluation (evaluation.py) finishes the
        # versions already due after training_finished, and stops at once on this.
        self.halt = asyncio.Event()
        self.rng = random.Random(ctx.spec.model.seed * 1_000_003 + 7919 * ctx.index + 1)
        self._servers = itertools.cycle(range(len(self.urls)))
        self.groups = 0
        self.samples = 0
        self.reward_sum = 0.0
        self.holds = 0
        self.started = time.monotonic()
        self.failed: BaseException | None = None
        self.seen_at: dict[int, int] = {}  # version -> documents_seen announced with it
        self.resampled = 0
        self.environment = environment
        if environment is not None:
            if tokenizer is None or encoder is None:
                raise ValueError("multi-turn episodes need the model's tokenizer and a message encoder")
            self.encoder = encoder
            self.limits: Limits = episode_limits(ctx.spec.task.environment, ctx.spec.model.max_sequence_length)
        # spec.evaluation: every replica trains on the task without the held-out prompts; the replica given the
        # eval set scores it (rlkube.core.actor.evaluation).
        fraction = held_out_fraction(ctx.spec)
        if fraction is not None:
            self.task = replace(task, prompt=TrainingPrompts(task, fraction).prompt)
            if draws_own_prompts(environment):
                self.environment = TrainingPrompts(environment, fraction)
        self.evaluator = Evaluator(self, ctx.spec, eval_set, refused=BadPrompt, stopped=Stopped) if eval_set else None

    # --- stopping ------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self.halt.set()
        self.stop.set()
        self.changed.set()  # wakes the workers holding at the lag bound
        self.changed = asyncio.Event()

    async def until_stopped(self, aw: Awaitable[T], stop: asyncio.Event | None = None) -> T:
        """Await `aw` unless the actor is asked to stop first (`stop`, default `self.stop`): then cancel it and
        raise Stopped. Only for waits that may be abandoned (an HTTP request, a pause), never for a Redis write."""
        task = asyncio.ensure_future(aw)
        stopping = asyncio.ensure_future((stop or self.stop).wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            stopping.cancel()
        if task.done():
            return task.result()  # done first (or together with the stop): its outcome counts
        task.cancel()
        await asyncio.wait({task})  # let it clean up (an HTTP request releases its connection)
        raise Stopped

    async def pause(self, seconds: float, stop: asyncio.Event | None = None) -> None:
        """Sleep, but no longer than until the actor is asked to stop (`stop`, default `self.stop`)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for((stop or self.stop).wait(), timeout=seconds)

    # --- events --------------------------------------------------------------------------------------

    async def _apply(self, event: protocol.TrainerEvent) -> None:
        if event.type == protocol.TRAINING_FINISHED:
            log.info("training_finished (%s): stopping after %d groups", event.stream_id, self.groups)
            self.view.finished = True
            self.stop.set()  # the workers are woken below
        elif event.type == protocol.WEIGHTS_READY:
            version, seen = documents_seen_of(event.payload, self.algo.samples_per_step)
            lowered = await self.lag.on_weights_ready(event.stream_id, seen)
            if lowered:
                log.warning("trainer went back to %d documents seen (a restart): lag credit lowered by %d",
                            seen, lowered)
            self.view.version, self.view.documents_seen = version, seen
            # Versions above this one belong to a trainer process that died (a restart resumes lower): forget
            # them, or groups would wait for weights that only come after the documents they are meant for.
            for stale in [v for v in self.seen_at if v > version]:
                del self.seen_at[stale]
            self.seen_at[version] = seen
            if self.evaluator is not None:
                self.evaluator.on_version(version)
            if len(self.seen_at) > 4096:
                self.seen_at.pop(min(self.seen_at))
            self.view.last_event_at = time.monotonic()
        else:
            return
        self.changed.set()
        self.changed = asyncio.Event()

    async def follow_events(self) -> None:
        """From the newest weights_ready/training_finished already in the stream on; reconnects on its own."""
        reader = streams.AsyncEventReader(self.redis, self.keys.events, None, stop=self.stop,
                                          latest_of=(protocol.WEIGHTS_READY, protocol.TRAINING_FINISHED))
        async for event in reader.follow(block_ms=1000, count=64):
            await self._apply(event)

    def _events_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # Without events the actor can neither follow the lag bound nor stop: fail loudly (a restart helps).
            log.error("following the events stream failed: %r", task.exception())
            self.failed = task.exception()
            self.request_stop()

    async def run(self) -> int:
        """The role's steps: follow the trainer's events -> wait for inference -> the workers (and evaluation)
        until the stop -> report."""
        events = asyncio.create_task(self.follow_events(), name="events")
        events.add_done_callback(self._events_done)
        try:
            async with aiohttp.ClientSession() as session:
                if not self.supervised:  # sft reads the dataset: it never asks inference
                    await self.wait_for_inference(session)
                if self.stop.is_set():
                    return 0
                await self._run_workers(session)
        finally:
            events.cancel()
            await asyncio.gather(events, return_exceptions=True)
        if self.failed is not None:
            raise self.failed
        self._report()
        return 0

    def _report(self) -> None:
        log.info("%s stopped: %d groups, %d samples, mean reward %.3f, %d reward errors in %d completions scored, "
                 "held %d times, %d groups sampled again (too old for their stream position)", self.name, self.groups,
                 self.samples, self.reward_sum / max(self.samples, 1), self.score.errors, self.score.scored,
                 self.holds, self.resampled)


def build_actor(ctx: RoleContext, client: aioredis.Redis) -> Actor:
    """The actor of this replica from its spec: the environment or task, the tokenizer and prompt rendering it
    needs, and (actor 0 with spec.evaluation) the eval set."""
    environment = load_environment(ctx.spec.task)
    # An environment that draws its own prompts is the task as far as prompts go (rendering, raw text or chat).
    task = (JobTask.of(environment) if draws_own_prompts(environment)
            else load_task(ctx.spec.task, shard=(ctx.index, ctx.spec.actor.replicas)))
    # The prompts are rendered here, not by inference, with the model's tokenizer (its chat template) unless the
    # task's prompts are raw text (the digit tasks): those go as text, tokenized by inference as vLLM does.
    chat = ctx.spec.task.chat_template
    tokenizer = None
    if (chat or (chat is None and not task.raw_prompts) or supervised(ctx.spec)
            or environment is not None):  # episodes decode replies and encode the environment's turns
        tokenizer = load_tokenizer(materialize_model(ctx.spec.model, ctx.model_cache_dir))
    render = prompt_renderer(ctx.spec.task, task, tokenizer=tokenizer.hf if tokenizer else None)
    encoder = None
    if environment is not None:
        encoder = MessageEncoder(tokenizer.hf, chat_template=render.chat_template)
    send: Callable[[Prompt], str | list[int]] = render
    if render.chat_template:
        # A rendered conversation holds the special tokens its template writes (a Llama template's BOS): send its
        # ids, tokenized without adding them again (a text prompt would get a second BOS from inference).
        def send(prompt: Prompt) -> list[int]:
            return tokenizer.hf(render(prompt), add_special_tokens=False)["input_ids"]
    stall_s = float(os.environ.get(ENV_STALL_SECONDS) or DEFAULT_STALL_S)
    # Actor 0 scores the eval set (spec.evaluation); a split that overlaps training stops it here, naming the field.
    eval_set = build_eval_set(ctx.spec, environment) if ctx.spec.evaluation is not None and ctx.index == 0 else None
    return Actor(ctx, client, task, stall_s=stall_s, render=send, tokenizer=tokenizer, environment=environment,
                 encoder=encoder, eval_set=eval_set)


async def amain() -> int:
    ctx = RoleContext.from_env()
    client = aioredis.Redis.from_url(ctx.redis_url, socket_timeout=30)
    actor = build_actor(ctx, client)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("signal %d: stopping", s), actor.request_stop()))
    try:
        return await actor.run()
    finally:
        await client.aclose()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s actor %(levelname)s %(message)s")
    # A task that cannot work (a missing dataset or column, ...) is a TaskError, a ConfigError: exit EXIT_CONFIG
    # with its message, which names the spec field, as the termination message.
    return errors.run_role(lambda: asyncio.run(amain()))
