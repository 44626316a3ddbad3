"""Rollout tasks: where prompts come from, how they become the text inference sees, and how completions are scored.

The actor samples a prompt, renders it (`prompt_renderer`: plain text, or the tokenizer's chat template), asks
inference for a group of completions, and scores each with a `Scorer` over the task's `reward`. A task is anything
with `name`, `prompt(rng)` and `reward(prompt, completion)`; `load_task` reads it once into a `JobTask`, the typed
record every caller uses. Where tasks come from:
- `spec.task.reasoningGym`: a reasoning-gym procedural task, scored by its own `score_answer`
  (rlkube.core.actor.gym_tasks);
- the built-ins below, tiny verifiable string tasks that a randomly initialised model can measurably learn on one
  CPU core (`rlkube tasks` lists them);
- `spec.task.dataset`: prompts from JSONL, Parquet or a `datasets` directory (rlkube.core.actor.prompt_dataset);
- `spec.task.entryPoint` (`package.module:factory`, called with `**spec.task.params`): any other.
`spec.task.reward` (rlkube.core.actor.rewards: math-verify, exact match, regex, a `module:function`) replaces the task's
own reward, comparing with the prompt's `meta["answer"]`.

The digit tasks give PARTIAL credit (per character, with a little credit for the right kind of character): with an
exact-match reward a random policy almost never scores, every group has equal rewards, and group-relative
advantages are all zero, so nothing would be learned. `repeat-digit` is the exception that stays learnable under
exact match: its answer is one token.

A reward that raises (or returns something that is not a finite number) scores that sample 0 and is counted
(`Scorer.errors`, and per sample into the trainer's `reward_errors` metric); it never stops the actor. A task that
cannot be built at all (a missing dataset, an unknown column) raises `TaskError`, naming the spec field.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from rlkube.api.task import TaskSpec
from rlkube.core.actor.rewards import build_reward, needs_answer
from rlkube.core.actor.task_types import Prompt, TaskError, import_attribute

log = logging.getLogger("rlkube.tasks")

DIGITS = "0123456789"


@runtime_checkable
class Task(Protocol):
    name: str

    def prompt(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


@dataclass(frozen=True, repr=False)
class JobTask:
    """The job's task as the actor uses it. The object behind it (`source`: a built-in, a dataset, reasoning-gym,
    a user's entry point, or an environment that draws its own prompts) is read once, here, for what it can do;
    no caller probes it for optional attributes afterwards."""

    name: str
    prompt: Callable[[random.Random], Prompt]
    reward: Callable[[Prompt, str], float] | None = None
    """None: nothing to score with here (a supervised dataset's reference completions; an environment's episodes,
    which score themselves)."""
    raw_prompts: bool = False
    """Prompts are raw text that inference tokenizes (the digit tasks): no chat template unless the spec asks."""
    needs_chat_template: str | None = None
    """The spec field that makes this task's prompts chat messages, which then need the chat template."""
    source: Any = None

    @classmethod
    def of(cls, obj: Any, name: str | None = None) -> JobTask:
        """`obj` read for its capabilities (a JobTask as it is). `name`: when `obj` has no string `name`."""
        if isinstance(obj, JobTask):
            return obj
        own_name, reward = getattr(obj, "name", None), getattr(obj, "reward", None)
        return cls(name=own_name if isinstance(own_name, str) else name or type(obj).__name__, prompt=obj.prompt,
                   reward=reward if callable(reward) else None, raw_prompts=bool(getattr(obj, "raw_prompts", False)),
                   needs_chat_template=getattr(obj, "needs_chat_template", None) or None, source=obj)

    def __repr__(self) -> str:
        return repr(self.source) if self.source is not None else f"JobTask({self.name!r})"


def char_match_reward(answer: str, completion: str, alphabet: str = DIGITS, kind_credit: float = 0.5) -> float:
    """Partial credit in [0, 1]: per answer position, 1 for the right character, `kind_credit` for a character
    of the right alphabet in the wrong place; divided by max(len(answer), len(completion)) so that extra
    characters cost (the model must learn to stop with <eos>)."""
    if not answer:
        return 1.0 if not completion else 0.0
    score = 0.0
    for i, expected in enumerate(answer):
        if i >= len(completion):
            break
        if completion[i] == expected:
            score += 1.0
        elif completion[i] in alphabet:
            score += kind_credit
    return score / max(len(answer), len(completion))


def _int_param(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TaskError(f"spec.task.params.{name}", f"expected an integer in [{low}, {high}], got {value!r}")
    return value


def _float_param(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise TaskError(f"spec.task.params.{name}", f"expected a number in [{low}, {high}], got {value!r}")
    return float(value)


class _DigitsTask:
    """Shared shape of the built-in digit tasks: prompt `"<digits>:"`, answer derived from the digits."""

    name = "digits"
    raw_prompts = True  # `"<digits>:"` as it is: no chat template unless spec.task.chatTemplate asks for one

    def __init__(self, min_digits: int = 1, max_digits: int = 2, kind_credit: float = 0.5):
        self.min_digits = _int_param("minDigits", min_digits, 1, 16)
        self.max_digits = _int_param("maxDigits", max_digits, 1, 16)
        if self.max_digits < self.min_digits:
            raise TaskError("spec.task.params.maxDigits",
                            f"{max_digits} must be >= spec.task.params.minDigits ({min_digits})")
        self.kind_credit = _float_param("kindCredit", kind_credit, 0.0, 1.0)

    def answer(self, digits: str) -> str:
        raise NotImplementedError

    def prompt(self, rng: random.Random) -> Prompt:
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return Prompt(f"{digits}:", {"answer": self.answer(digits)})

    def reward(self, prompt: Prompt, completion: str) -> float:
        return char_match_reward(prompt.meta["answer"], completion, DIGITS, self.kind_credit)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(min_digits={self.min_digits}, max_digits={self.max_digits})"


class ReverseDigits(_DigitsTask):
    """Reverse the digits before the colon."""

    name = "reverse-digits"

    def answer(self, digits: str) -> str:
        return digits[::-1]


class CopyDigits(_DigitsTask):
    """Copy the digits before the colon (easier than reversing: a fixed look-back distance)."""

    name = "copy-digits"

    def answer(self, digits: str) -> str:
        return digits


class RepeatDigit:
    """Repeat the digit the prompt names, scored by exact match: learnable from scratch under an exact-match
    reward because the answer is a single token (plus stopping)."""

    name = "repeat-digit"

    def __init__(self, template: str = "repeat {digit}:", match: str = "full", digits: str = DIGITS):
        if not isinstance(template, str) or "{digit}" not in template:
            raise TaskError("spec.task.params.template", f"must contain {{digit}}, got {template!r}")
        try:
            template.format(digit="0")
        except (IndexError, KeyError, ValueError) as exc:
            raise TaskError("spec.task.params.template", f"{template!r} is not a format string: {exc}") from None
        if match not in ("full", "prefix"):
            raise TaskError("spec.task.params.match", f"`full` or `prefix`, got {match!r}")
        if not isinstance(digits, str) or not digits or not set(digits) <= set(DIGITS):
            raise TaskError("spec.task.params.digits", f"the digits prompts may name, e.g. '0123', got {digits!r}")
        self.template = template
        self.match = match
        self.digits = "".join(sorted(set(digits)))  # fewer digits: an easier task (a random digit is right more often)

    def prompt(self, rng: random.Random) -> Prompt:
        digit = rng.choice(self.digits)
        return Prompt(self.template.format(digit=digit), {"answer": digit})

    def reward(self, prompt: Prompt, completion: str) -> float:
        got, answer = completion.strip(), prompt.meta["answer"]
        return float(got.startswith(answer) if self.match == "prefix" else got == answer)

    def __repr__(self) -> str:
        return f"RepeatDigit(template={self.template!r}, match={self.match!r}, digits={self.digits!r})"


def _camel_to_snake(params: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in params.items():
        out["".join("_" + c.lower() if c.isupper() else c for c in key)] = value
    return out


def _builtin(cls: type) -> Callable[..., Task]:
    def factory(**params: Any) -> Task:
        try:
            return cls(**_camel_to_snake(params))
        except TypeError as exc:
            raise TaskError("spec.task.params", f"{exc} (task {cls.name!r})") from None

    factory.__doc__ = cls.__doc__
    return factory


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    ReverseDigits.name: _builtin(ReverseDigits),
    CopyDigits.name: _builtin(CopyDigits),
    RepeatDigit.name: _builtin(RepeatDigit),
}


def load_task(spec: TaskSpec, shard: tuple[int, int] = (0, 1)) -> JobTask:
    """The job's task: prompts from `spec.dataset`, `spec.entryPoint` called with `**spec.params`, or the built-in
    `spec.name`; its reward replaced by `spec.reward` when set. `shard` = (this actor replica, replicas): dataset
    tasks draw their rows in turns so that replicas do not repeat each other. Raises TaskError."""
    if spec.dataset is not None:
        # Imported here: it needs numpy (and `datasets` for a directory), which `rlkube tasks` on the base
        # install (no training stack) and tasks without a dataset do without.
        from rlkube.core.actor.prompt_dataset import DatasetTask

        if spec.reward is None and spec.dataset.completion_field is None:  # sft reads completions, scores none
            raise TaskError("spec.task.reward", "required with spec.task.dataset (math, exact, regex or python)")
        task: Any = DatasetTask.load(spec.name, spec.dataset, shard)
        spec_field, where = "spec.task.dataset", f"spec.task.dataset {spec.dataset.path!r}"
    elif spec.reasoning_gym is not None:
        from rlkube.core.actor import gym_tasks  # imported here: reasoning-gym is an optional extra (`agents`)

        task = gym_tasks.load(spec.reasoning_gym, shard)
        spec_field, where = "spec.task.reasoningGym", f"spec.task.reasoningGym {spec.reasoning_gym.name!r}"
    elif spec.entry_point:
        factory = import_attribute(spec.entry_point, "spec.task.entryPoint")
        task = factory(**spec.params)
        spec_field, where = "spec.task.entryPoint", f"spec.task.entryPoint {spec.entry_point!r}"
    else:
        factory = BUILTIN_TASKS.get(spec.name)
        if factory is None:
            raise TaskError("spec.task.name", f"unknown built-in task {spec.name!r} (known: {', '.join(BUILTIN_TASKS)})")
        task = factory(**spec.params)
        spec_field, where = "spec.task.name", f"spec.task.name {spec.name!r}"
    supervised = spec.dataset is not None and spec.dataset.completion_field is not None
    needed = ("prompt",) if spec.reward is not None or supervised else ("prompt", "reward")
    for attr in needed:
        if not callable(getattr(task, attr, None)):
            raise TaskError(spec_field, f"{where} returned {task!r}, which has no {attr}() method")
    job_task = JobTask.of(task, name=spec.name)
    if spec.reward is not None:
        if spec.dataset is not None and needs_answer(spec.reward) and task.answer_column is None:
            raise TaskError("spec.task.dataset.answerField", f"the {spec.reward.type} reward compares with a reference "
                            f"answer, but {spec.dataset.path} has no `answer` column: name the column that holds it")
        job_task = replace(job_task, reward=build_reward(spec.reward))
    return job_task


# --- rendering: a Prompt -> the text inference completes ---------------------------------------------------


def has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def render_prompt(prompt: Prompt, tokenizer: Any = None) -> str:
    """The text inference completes. `tokenizer` (anything with `apply_chat_template`, e.g. a transformers
    tokenizer): render through its chat template, a plain-text prompt becoming one user message; None: the plain
    text (a chat prompt then cannot be rendered)."""
    if tokenizer is None:
        if prompt.messages is not None:
            raise TaskError("spec.task.chatTemplate", "this task's prompts are chat messages; they need the "
                            "tokenizer's chat template")
        return prompt.text
    messages = [dict(m) for m in prompt.messages] if prompt.messages is not None else [
        {"role": "user", "content": prompt.text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if not isinstance(text, str):
        raise TaskError("spec.task.chatTemplate", f"the tokenizer's chat template rendered {type(text).__name__}, "
                        "not text")
    return text


@dataclass(frozen=True)
class PromptRenderer:
    """A Prompt -> the text inference completes; `chat_template`: whether that text is a rendered conversation."""

    tokenizer: Any
    """The tokenizer whose chat template renders; None: plain text."""

    @property
    def chat_template(self) -> bool:
        return self.tokenizer is not None

    def __call__(self, prompt: Prompt) -> str:
        return render_prompt(prompt, self.tokenizer)


def prompt_renderer(spec: TaskSpec, task: JobTask, tokenizer: Any = None) -> PromptRenderer:
    """What the actor calls on every prompt: `render_prompt` with the chat template on or off as `spec.chatTemplate`
    says (unset: on when the tokenizer has one, unless the task's prompts are raw text). Raises TaskError, naming
    the field, when the task's prompts need a chat template the job cannot use."""
    available = has_chat_template(tokenizer)
    flag = spec.chat_template
    use = (available and not task.raw_prompts) if flag is None else flag
    if use and not available:
        raise TaskError("spec.task.chatTemplate", "is true, but the model's tokenizer has no chat template")
    needs = task.needs_chat_template
    if needs and not use:
        why = "spec.task.chatTemplate is false" if available else "the model's tokenizer has no chat template"
        raise TaskError(needs, f"makes prompts chat messages, which need the chat template, but {why}")
    return PromptRenderer(tokenizer if use else None)


# --- scoring: a reward that fails scores 0 and is counted, never fatal -------------------------------------

_LOGGED_ERRORS = 5  # the first few failures are logged with their traceback; later ones every LOG_EVERY-th
_LOG_EVERY = 100


@dataclass
class Scorer:
    """Scores completions with `task.reward`. An exception, or a result that is not a finite number, scores 0,
    counts in `errors` and reports the sample as failed; the actor carries on."""

    task: JobTask
    errors: int = 0
    scored: int = 0

    def __call__(self, prompt: Prompt, completion: str) -> tuple[float, bool]:
        """(reward, failed)."""
        self.scored += 1
        try:
            if self.task.reward is None:
                raise TypeError(f"task {self.task.name!r} has no reward")
            value = self.task.reward(prompt, completion)
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"the reward is {value!r}, not a finite number")
        except Exception as exc:  # noqa: BLE001 - any failure of user code is one failed sample
            self.errors += 1
            if self.errors <= _LOGGED_ERRORS or self.errors % _LOG_EVERY == 0:
                log.warning("reward of task %s failed on prompt %r (%d failures in %d samples; each scores 0): %s: %s",
                            self.task.name, prompt.text[:200], self.errors, self.scored, type(exc).__name__, exc,
                            exc_info=self.errors <= _LOGGED_ERRORS)
            return 0.0, True
        return reward, False


def cli(args: Any) -> int:
    """`rlkube tasks`: the built-in task names, their parameters and an example prompt/answer."""
    import inspect

    rng = random.Random(0)
    for name, factory in BUILTIN_TASKS.items():
        task = factory()
        params = inspect.signature(type(task).__init__).parameters
        shown = ", ".join(
            f"{''.join(w if i == 0 else w.title() for i, w in enumerate(p.split('_')))}={v.default!r}"
            for p, v in params.items() if p != "self"
        )
        p = task.prompt(rng)
        doc = " ".join((factory.__doc__ or "").split())
        print(f"{name:16} {doc} e.g. {p.text!r} -> {p.meta['answer']!r}; params: {shown}")
    print("dataset tasks: spec.task.dataset (JSONL, Parquet or a `datasets` directory) with spec.task.reward "
          "(math, exact, regex, or python `package.module:function`)")
    print("reasoning-gym tasks: spec.task.reasoningGym = {name: basic_arithmetic, config: {...}, seed} (the "
          "`agents` extra; scored by the task's own score_answer)")
    print("custom tasks: spec.task.entryPoint = 'package.module:factory' (called with **spec.task.params)")
    print("multi-turn environments: spec.task.environment.name = 'calculator' (a reply with `?` calls the calculator "
          "on the prompt's sum, the next must repeat its answer; params maxOperand, operations, callCredit, "
          "kindCredit), 'verifiers' (params.taskset: a verifiers taskset's id, run through the episode interface; the "
          "`agents` extra), or spec.task.environment.entryPoint = 'package.module:factory' "
          "(rlkube.core.actor.episodes)")
    return 0
