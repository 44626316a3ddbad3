"""Rollout tasks: where prompts come from and how a completion is scored.

The actor samples a prompt, asks inference for a group of completions, and scores each with `reward`. A task is
anything with `name`, `prompt(rng)` and `reward(prompt, completion)`; the built-ins below are tiny verifiable
string tasks that a randomly initialised character model can measurably learn on one CPU core, and
`spec.task.entryPoint` (`package.module:factory`, called with `**spec.task.params`) plugs in any other.

Rewards are in [0, 1] and give PARTIAL credit (per character, with a little credit for the right kind of
character): with an exact-match reward a random policy almost never scores, every group has equal rewards, and
group-relative advantages are all zero, so nothing would be learned.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rlkube.api.spec import TaskSpec

DIGITS = "0123456789"


@dataclass(frozen=True)
class Prompt:
    """One prompt. `meta` carries whatever `reward` needs (for the built-ins: the expected answer)."""

    text: str
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Task(Protocol):
    name: str

    def prompt(self, rng: random.Random) -> Prompt: ...

    def reward(self, prompt: Prompt, completion: str) -> float: ...


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
        raise ValueError(f"spec.task.params.{name}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _float_param(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"spec.task.params.{name}: expected a number in [{low}, {high}], got {value!r}")
    return float(value)


class _DigitsTask:
    """Shared shape of the built-in digit tasks: prompt `"<digits>:"`, answer derived from the digits."""

    name = "digits"

    def __init__(self, min_digits: int = 1, max_digits: int = 2, kind_credit: float = 0.5):
        self.min_digits = _int_param("minDigits", min_digits, 1, 16)
        self.max_digits = _int_param("maxDigits", max_digits, 1, 16)
        if self.max_digits < self.min_digits:
            raise ValueError(
                f"spec.task.params.maxDigits ({max_digits}) must be >= spec.task.params.minDigits ({min_digits})"
            )
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


def _camel_to_snake(params: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in params.items():
        out["".join("_" + c.lower() if c.isupper() else c for c in key)] = value
    return out


def _builtin(cls: type[_DigitsTask]) -> Callable[..., Task]:
    def factory(**params: Any) -> Task:
        try:
            return cls(**_camel_to_snake(params))
        except TypeError as exc:
            raise ValueError(f"spec.task.params: {exc} (task {cls.name!r})") from None

    factory.__doc__ = cls.__doc__
    return factory


BUILTIN_TASKS: dict[str, Callable[..., Task]] = {
    ReverseDigits.name: _builtin(ReverseDigits),
    CopyDigits.name: _builtin(CopyDigits),
}


def _import_entry_point(entry_point: str) -> Callable[..., Any]:
    module_name, _, attr = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"spec.task.entryPoint: cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"spec.task.entryPoint: module {module_name!r} has no attribute {attr!r}") from None


def load_task(spec: TaskSpec) -> Task:
    """The job's task: `spec.entryPoint` called with `**spec.params` when set, else the built-in `spec.name`."""
    if spec.entry_point:
        factory = _import_entry_point(spec.entry_point)
        task = factory(**spec.params)
        where = f"spec.task.entryPoint {spec.entry_point!r}"
    else:
        factory = BUILTIN_TASKS.get(spec.name)
        if factory is None:
            raise ValueError(f"spec.task.name: unknown built-in task {spec.name!r} (known: {', '.join(BUILTIN_TASKS)})")
        task = factory(**spec.params)
        where = f"spec.task.name {spec.name!r}"
    for attr in ("prompt", "reward"):
        if not callable(getattr(task, attr, None)):
            raise ValueError(f"{where} returned {task!r}, which has no {attr}() method")
    if not isinstance(getattr(task, "name", None), str):
        try:
            task.name = spec.name  # type: ignore[misc]
        except AttributeError:
            raise ValueError(f"{where} returned {task!r}, which has no string `name`") from None
    return task


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
        print(f"{name:16} {(factory.__doc__ or '').strip()} e.g. {p.text!r} -> {p.meta['answer']!r}; params: {shown}")
    print("custom tasks: spec.task.entryPoint = 'package.module:factory' (called with **spec.task.params)")
    return 0
