"""Multi-turn episodes: the model replies, an environment answers (tool results, a user's next message), and the
episode ends with a reward. Kept as the exact token ids the engine sampled, so training sees what was sampled.

An `Environment` starts an `Episode` from a task's prompt or draws its own (`prompt(rng)`); the episode answers
each reply with `respond(reply)` (messages, a `Turn` with the turn's reward, or None when it is over) and is scored
by `reward()` however it ended. Why token ids and not text: re-rendering the history re-tokenizes what the model
wrote, so the trainer would learn on tokens the engine never sampled; `run_episode` appends only the environment's
new messages and counts the episodes a whole re-render would change (`drifted`). The environment's calls are
user code and run on threads of their own (`call_with_timeout`), so a tool that hangs ends its episode, never the
actor. The record, the limits, the counts and per-turn rewards: docs/design.md §5.3.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlkube.core.actor.task_types import Message, Prompt

log = logging.getLogger("rlkube.episodes")


@runtime_checkable
class Episode(Protocol):
    def respond(self, reply: str) -> Sequence[Message] | Turn | None:
        """The environment's answer to the model's reply: messages to append, or None/[] when the episode ends;
        a `Turn` to give the turn a reward too."""
        ...

    def reward(self) -> float:
        """The episode's score, called once at its end."""
        ...


@runtime_checkable
class Environment(Protocol):
    name: str

    def start(self, prompt: Prompt) -> Episode: ...


@dataclass(frozen=True)
class Turn:
    """An answer with the turn's reward: what `respond` may return instead of bare messages."""

    messages: Sequence[Message] | None
    reward: float | None = None


@dataclass(frozen=True)
class Limits:
    max_turns: int = 4
    max_episode_tokens: int | None = None  # prompt + every reply + every environment message
    tool_timeout_s: float = 10.0
    episode_timeout_s: float | None = None  # from the first reply to the last; scoring excluded
    sum_turn_rewards: bool = False  # the episode's reward: per-turn rewards + reward() (else reward() alone)


TOOL_COUNTS = ("tool_errors", "tool_timeouts", "sandbox_refusals")
_tally: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("rlkube_episode_tools", default=None)


def note_tool(*counts: str) -> None:
    """Count a tool's failure (names from TOOL_COUNTS) on the episode whose environment call is running; nothing
    outside an episode (a tool called from a test or a script)."""
    tally = _tally.get()
    if tally is not None:
        for name in counts:
            tally[name] = tally.get(name, 0) + 1


class ToolTimeout(Exception):
    pass


class SampleRefused(Exception):
    """The engine refused the next turn's prompt (say, too long for the model): the episode ends truncated."""


async def call_with_timeout(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """fn(*args) on a daemon thread of its own; ToolTimeout after `timeout` seconds (the thread is abandoned).

    Not the loop's default executor: its few threads would fill up with hung tools and every later call would
    wait behind them."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    context = contextvars.copy_context()  # the episode's tally (note_tool), as asyncio.to_thread does

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def target() -> None:
        try:
            outcome = (True, context.run(fn, *args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # a call that came back after its timeout, once the loop had closed: nobody waits
            pass

    threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(done), timeout)
    except TimeoutError:
        raise ToolTimeout(f"{getattr(fn, '__qualname__', fn)} took over {timeout:g}s") from None


class MessageEncoder:
    """Environment messages -> the token ids to append after the model's last reply.

    With a chat template: the template applied to the NEW messages only (plus the generation prompt that opens
    the model's next turn), as the difference between rendering [anchor + new] and [anchor], where `anchor` is
    one empty user message: a template that writes a BOS or a system prompt at the start writes it into the
    anchor, not into the appended turn. Before them comes what the template writes to close the model's turn
    (`closing`, Qwen's "<|im_end|>\n") less the stop token the engine already sampled: the separator the template
    puts after a turn is part of the environment's span, so the episode's ids are the template's rendering of
    the conversation (no drift) while every sampled id stays as sampled. Without a template: the contents as
    plain text, no special tokens."""

    ANCHOR = ({"role": "user", "content": ""},)
    _REPLY = "RLKUBE-REPLY-MARKER"

    def __init__(self, hf_tokenizer: Any, chat_template: bool):
        self.hf = hf_tokenizer
        self.chat = chat_template and bool(getattr(hf_tokenizer, "chat_template", None))
        if self.chat:
            self._anchor = self._render(list(self.ANCHOR), generation=False)
            turn = self._render([*self.ANCHOR, {"role": "assistant", "content": self._REPLY}], generation=False)
            self.closing = turn.split(self._REPLY, 1)[1] if self._REPLY in turn else ""

    def _render(self, messages: list[Message], generation: bool) -> str:
        return self.hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def __call__(self, messages: Sequence[Message], stop_token: int | None = None) -> list[int]:
        """The ids of `messages` after a reply that ended with `stop_token` (None: cut by max_tokens, or no
        template to close the turn)."""
        if self.chat:
            full = self._render([*self.ANCHOR, *map(dict, messages)], generation=True)
            if not full.startswith(self._anchor):
                raise ValueError("the chat template renders the messages before the new ones differently when more "
                                 "follow: appended turns cannot be rendered alone")
            closing = self.closing
            if stop_token is not None:
                stop = self.hf.decode([stop_token], skip_special_tokens=False)
                if stop and closing.startswith(stop):
                    closing = closing[len(stop):]
            text = closing + full[len(self._anchor):]
        else:
            text = "".join(m["content"] for m in messages)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def rerender(self, prompt: Prompt, result: EpisodeResult) -> list[int]:
        """The ids of the whole conversation rendered at once from its messages (the prompt's, then the episode's),
        as a system that re-renders history between turns would train on; compare with the exact ids."""
        if self.chat:
            head = list(prompt.messages) if prompt.messages else [{"role": "user", "content": prompt.text}]
            text = self.hf.apply_chat_template([*map(dict, head), *map(dict, result.messages)],
                                               add_generation_prompt=False, tokenize=False)
            return list(self.hf(text, add_special_tokens=False)["input_ids"])
        # A text prompt is tokenized by the engine with the tokenizer's special tokens (a BOS), as here.
        return list(self.hf(prompt.text + "".join(m["content"] for m in result.messages))["input_ids"])

    def drifted(self, prompt: Prompt, result: EpisodeResult) -> bool:
        """Whether the whole conversation rendered at once differs from the episode's exact ids. The rendering
        also closes the last reply (what `closing` leaves after its stop token), which the episode, ending where
        sampling ended, does not hold: that tail is not drift."""
        again, exact = self.rerender(prompt, result), result.prompt_ids + result.tokens
        if not self.chat:  # text has no stop tokens: the last reply's is not drift, an earlier one lost is
            return again != (exact[:-1] if result.finished and result.tokens else exact)
        rest = self.closing
        if result.finished and result.tokens:
            stop = self.hf.decode(result.tokens[-1:], skip_special_tokens=False)
            rest = rest[len(stop):] if stop and rest.startswith(stop) else rest
        return again[:len(exact)] != exact or self.hf.decode(again[len(exact):], skip_special_tokens=False) != rest


@dataclass
class Reply:
    """One sampled turn, as the engine returned it."""

    token_ids: list[int]
    logprobs: list[float]
    version: int  # the oldest weights that sampled it
    finished: bool  # ended by a stop token (not by max_tokens)
    prompt_ids: list[int] | None = None  # the engine's ids of the prompt (the first turn's tells its ids)
    versions: list[int] | None = None  # per token, when the engine says (an update may land mid-reply)


@dataclass
class EpisodeResult:
    """The whole episode as token ids after the prompt: the sampled spans with their log-probs and versions, the
    environment's spans (`env_spans`, [begin, end) into `tokens`) with log-prob 0 and the version before them."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0  # environment answers (each `respond` that returned messages)
    tool_errors: int = 0  # `respond` or `reward` raised (or returned no finite number)
    tool_timeouts: int = 0
    sandbox_refusals: int = 0  # the sandbox refused a tool's snippet (no network; counted as tool errors too)
    truncated: bool = False  # ended by a limit (turns, tokens, time) while the environment wanted to go on
    timed_out: bool = False  # ended by episodeTimeoutSeconds
    turn_rewards: list[float] = field(default_factory=list)
    finished: bool = True
    reward_error: bool = False
    messages: list[Message] = field(default_factory=list)  # the replies (decoded) and the environment's messages
    drifted: bool = False  # re-rendering `messages` gives other ids than the exact ones (set by the caller)

    def add(self, ids: list[int], logprobs: list[float] | None, version: int | list[int]) -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += version if isinstance(version, list) else [version] * len(ids)
        if logprobs is None and ids:
            self.env_spans.append((start, len(self.tokens)))

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def counts(self) -> dict[str, int | float]:
        """The episode's counts as its sample carries them (`Sample.episode`), each of its counter's type
        (rlkube.contract.counters.EPISODE; `episodes` is the group's to add)."""
        return {"turns": self.turns, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors,
                "tool_timeouts": self.tool_timeouts, "sandbox_refusals": self.sandbox_refusals,
                "truncated": int(self.truncated), "timed_out": int(self.timed_out), "drifted": int(self.drifted),
                "turn_rewards": len(self.turn_rewards), "turn_reward_sum": float(sum(self.turn_rewards))}


Sampler = Callable[[list[int], int], Awaitable[Reply]]
"""(prompt ids, max_tokens) -> one reply; raises to abandon the episode (the actor is stopping)."""


async def run_episode(episode: Episode, first: Reply, sample: Sampler, encode: MessageEncoder,
                      decode: Callable[[list[int]], str], limits: Limits, max_new_tokens: int) -> EpisodeResult:
    """Play one episode from its first reply (sampled by the caller, often with its group in one request) to its
    end, and score it. `first.prompt_ids` must hold the engine's ids of the prompt."""
    assert first.prompt_ids is not None
    result = EpisodeResult(prompt_ids=list(first.prompt_ids))
    tally: dict[str, int] = {}
    token = _tally.set(tally)
    try:
        deadline = asyncio.timeout(limits.episode_timeout_s)
        try:
            async with deadline:
                await _play(episode, first, sample, encode, decode, limits, max_new_tokens, result)
        except TimeoutError:
            if not deadline.expired():
                raise
            result.timed_out = result.truncated = True
            _drop_unanswered(result)
            log.warning("episode ended: over its time limit of %gs (after %d turns)", limits.episode_timeout_s,
                        result.turns)
        await _score(episode, result, limits)
    finally:
        _tally.reset(token)
    for name in TOOL_COUNTS:
        setattr(result, name, getattr(result, name) + tally.get(name, 0))
    return result


async def _play(episode: Episode, reply: Reply, sample: Sampler, encode: MessageEncoder,
                decode: Callable[[list[int]], str], limits: Limits, max_new_tokens: int,
                result: EpisodeResult) -> None:
    """The turns, adding to `result` as they go (an episode cut by its time limit keeps what it had)."""
    while True:
        result.add(reply.token_ids, reply.logprobs, reply.versions if reply.versions is not None else reply.version)
        result.turns += 1
        result.finished = reply.finished
        text = decode(reply.token_ids)
        result.messages.append({"role": "assistant", "content": text})
        try:
            answer = await call_with_timeout(episode.respond, text, timeout=limits.tool_timeout_s)
        except ToolTimeout as exc:
            result.tool_timeouts += 1
            log.warning("episode ended: the environment's answer timed out (%s)", exc)
            return
        except Exception as exc:  # noqa: BLE001 - the environment's code: a failed tool ends the episode
            result.tool_errors += 1
            log.warning("episode ended: the environment failed: %s: %s", type(exc).__name__, exc)
            return
        if isinstance(answer, Turn):
            if answer.reward is not None:
                try:
                    result.turn_rewards.append(_finite(answer.reward))
                except (TypeError, ValueError) as exc:
                    result.tool_errors += 1
                    log.warning("episode ended: the turn's reward is unusable: %s", exc)
                    return
            answer = answer.messages
        if not answer:
            return
        if result.turns >= limits.max_turns:
            result.truncated = True
            return
        try:
            ids = encode(answer, reply.token_ids[-1] if reply.finished and reply.token_ids else None)
        except Exception as exc:  # noqa: BLE001 - an answer that is not messages the template can render
            result.tool_errors += 1
            log.warning("episode ended: the environment's answer %r cannot be tokenized: %s: %s", answer,
                        type(exc).__name__, exc)
            return
        budget = limits.max_episode_tokens
        room = None if budget is None else budget - result.length - len(ids)
        if room is not None and room < 1:
            result.truncated = True  # no room for the answer and one more sampled token
            return
        result.tool_calls += 1
        result.messages += [dict(m) for m in answer]
        result.add(ids, None, result.versions[-1] if result.versions else reply.version)
        try:
            reply = await sample(result.prompt_ids + result.tokens,
                                 max_new_tokens if room is None else min(max_new_tokens, room))
        except SampleRefused as exc:
            result.truncated = True
            log.warning("episode truncated: %s", exc)
            return


def _drop_unanswered(result: EpisodeResult) -> None:
    """An episode cut while its next reply was being sampled ends with the environment's answer that no reply
    follows: dropped, so the episode ends on the model's last turn, as its conversation does."""
    if result.env_spans and result.env_spans[-1][1] == len(result.tokens):
        begin = result.env_spans.pop()[0]
        del result.tokens[begin:], result.logprobs[begin:], result.versions[begin:]
        last_reply = max(i for i, m in enumerate(result.messages) if m["role"] == "assistant")
        del result.messages[last_reply + 1:]


def _finite(value: Any) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    return number


async def _score(episode: Episode, result: EpisodeResult, limits: Limits) -> None:
    """The episode's reward: reward(), plus the per-turn rewards with limits.sum_turn_rewards; 0 if it fails."""
    try:
        value = await call_with_timeout(episode.reward, timeout=limits.tool_timeout_s)
        reward = _finite(value)
        result.reward = reward + (sum(result.turn_rewards) if limits.sum_turn_rewards else 0.0)
    except ToolTimeout as exc:
        result.tool_timeouts += 1
        result.reward_error = True
        log.warning("episode reward timed out (%s); scored 0", exc)
    except Exception as exc:  # noqa: BLE001 - the environment's code
        result.tool_errors += 1
        result.reward_error = True
        log.warning("episode reward failed (%s: %s); scored 0", type(exc).__name__, exc)


def draws_own_prompts(environment: Any) -> bool:
    """Whether an environment draws its own prompts (it has `prompt(rng)`): it is then the job's one prompt source
    (docs/design.md §2.4). The one place that asks; a user's environment may or may not have the method."""
    return environment is not None and callable(getattr(environment, "prompt", None))


def draw_prompt(environment: Any, task: Any, rng: random.Random) -> Prompt:
    """The environment's own prompt if it draws them, else the task's."""
    return environment.prompt(rng) if draws_own_prompts(environment) else task.prompt(rng)
