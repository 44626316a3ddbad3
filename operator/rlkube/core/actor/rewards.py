"""Rewards from `spec.task.reward`: verifiers that compare a completion with the prompt's reference answer, or a
user's function.

- `math`: math-verify (https://github.com/huggingface/Math-Verify) extracts the final answer from the completion
  (LaTeX, `\\boxed{}`, plain expressions) and checks it is mathematically equal to the reference answer: "4",
  "\\boxed{4}", "2+2" and "$\\frac{8}{2}$" all match a reference of 4.
- `exact`: string equality after normalisation (trim, collapse whitespace, case), of the whole completion or its
  beginning.
- `regex`: 1 when the pattern matches the completion (a format reward); a group named `answer` in the pattern
  must also equal the reference answer.
- `python`: `package.module:function(completion, answer, sample, **params) -> float`, `sample` being the prompt's
  dataset row (or its `meta` for generated prompts).
`answerPattern` first cuts the answer out of the completion for math/exact (no match scores 0).

Every reward is a callable `(prompt, completion) -> float`, the shape of `Task.reward`, so a reward spec can replace
any task's own reward. Reference answers come from `prompt.meta["answer"]`. A sample that cannot be scored (no
reference answer, one math-verify cannot read) raises RewardError, which the actor's Scorer turns into reward 0 and
a counted error, like any exception of a user's function.

math-verify bounds its parsing and comparison with SIGALRM timers, which work in the main thread only: the actor
scores in its event loop, on the main thread.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from rlkube.api.task import RewardSpec
from rlkube.core.actor.task_types import Prompt, TaskError, import_attribute

RewardFn = Callable[[Prompt, str], float]


class RewardError(ValueError):
    """This sample cannot be scored (scored 0 and counted, never fatal)."""


def normalize(text: str, mode: str = "strip", ignore_case: bool = False) -> str:
    """`none`: as is; `strip`: trimmed at both ends; `whitespace`: trimmed, inner runs of whitespace -> one space."""
    if mode == "strip":
        text = text.strip()
    elif mode == "whitespace":
        text = " ".join(text.split())
    elif mode != "none":
        raise ValueError(f"unknown normalisation {mode!r}")
    return text.casefold() if ignore_case else text


def reference_answer(prompt: Prompt) -> str:
    answer = prompt.meta.get("answer")
    if answer is None:
        raise RewardError("the prompt has no reference answer (spec.task.dataset.answerField is empty in this row)")
    return answer if isinstance(answer, str) else str(answer)


def extract_answer(pattern: re.Pattern[str] | None, completion: str) -> str | None:
    """The part of `completion` the answer pattern captures (group `answer`, else group 1); the whole completion
    without a pattern; None when the pattern does not match."""
    if pattern is None:
        return completion
    m = pattern.search(completion)
    if m is None:
        return None
    return m.group("answer") if "answer" in pattern.groupindex else m.group(1)


class MathReward:
    """1.0 when math-verify finds the completion's answer equal to the reference answer, else 0.0."""

    def __init__(self, answer_pattern: str | None = None):
        import math_verify  # imported here: a job without a math reward does not need it

        self._parse = math_verify.parse
        self._verify = math_verify.verify
        self.answer_pattern = re.compile(answer_pattern) if answer_pattern else None
        self._gold = functools.lru_cache(maxsize=4096)(self._parse_gold)

    def _parse_gold(self, answer: str) -> list:
        """The parsed reference, or [] when math-verify finds no expression in it (only its string fallback)."""
        for text in (answer, f"${answer}$"):  # a bare LaTeX answer ("\\frac{1}{2}") is found inside delimiters
            parsed = self._parse(text)
            if any(not isinstance(x, str) for x in parsed):
                return parsed
        return []

    def __call__(self, prompt: Prompt, completion: str) -> float:
        gold = self._gold(reference_answer(prompt))
        if not gold:
            raise RewardError(f"math-verify cannot read the reference answer {prompt.meta.get('answer')!r}")
        text = extract_answer(self.answer_pattern, completion)
        if text is None:
            return 0.0
        predicted = self._parse(text)
        return 1.0 if predicted and self._verify(gold, predicted) else 0.0

    def __repr__(self) -> str:
        return f"MathReward(answer_pattern={self.answer_pattern and self.answer_pattern.pattern!r})"


class ExactReward:
    """1.0 when the (extracted, normalised) completion equals the normalised reference answer, or with
    match=prefix begins with it."""

    def __init__(self, normalize: str = "strip", ignore_case: bool = False, match: str = "full",
                 answer_pattern: str | None = None):
        self.normalize, self.ignore_case, self.match = normalize, ignore_case, match
        self.answer_pattern = re.compile(answer_pattern) if answer_pattern else None

    def __call__(self, prompt: Prompt, completion: str) -> float:
        answer = normalize(reference_answer(prompt), self.normalize, self.ignore_case)
        text = extract_answer(self.answer_pattern, completion)
        if text is None:
            return 0.0
        got = normalize(text, self.normalize, self.ignore_case)
        return float(got.startswith(answer) if self.match == "prefix" else got == answer)

    def __repr__(self) -> str:
        return f"ExactReward(normalize={self.normalize!r}, ignore_case={self.ignore_case}, match={self.match!r})"


class RegexReward:
    """1.0 when `pattern` matches the completion (re.search), and its group `answer`, if it has one, equals the
    reference answer after normalisation."""

    def __init__(self, pattern: str, normalize: str = "strip", ignore_case: bool = False):
        self.pattern = re.compile(pattern, re.IGNORECASE if ignore_case else 0)
        self.normalize, self.ignore_case = normalize, ignore_case

    def __call__(self, prompt: Prompt, completion: str) -> float:
        m = self.pattern.search(completion)
        if m is None:
            return 0.0
        if "answer" not in self.pattern.groupindex:
            return 1.0
        got = m.group("answer")
        answer = normalize(reference_answer(prompt), self.normalize, self.ignore_case)
        return float(got is not None and normalize(got, self.normalize, self.ignore_case) == answer)

    def __repr__(self) -> str:
        return f"RegexReward({self.pattern.pattern!r})"


class PythonReward:
    """`function(completion, answer, sample, **params)`: answer = the prompt's reference answer (None when it has
    none), sample = the dataset row (the prompt's meta for generated prompts)."""

    def __init__(self, function: str, params: dict[str, Any] | None = None):
        self.function_name = function
        self.function = import_attribute(function, "spec.task.reward.function")
        if not callable(self.function):
            raise TaskError("spec.task.reward.function", f"{function} is a {type(self.function).__name__}, "
                            "not a function")
        self.params = dict(params or {})

    def __call__(self, prompt: Prompt, completion: str) -> float:
        sample = prompt.meta.get("sample", prompt.meta)
        return self.function(completion, prompt.meta.get("answer"), sample, **self.params)

    def __repr__(self) -> str:
        return f"PythonReward({self.function_name})"


def needs_answer(spec: RewardSpec) -> bool:
    """Whether the reward compares with a reference answer (a python reward decides for itself)."""
    if spec.type in ("math", "exact"):
        return True
    return spec.type == "regex" and spec.pattern is not None and "answer" in re.compile(spec.pattern).groupindex


def build_reward(spec: RewardSpec) -> RewardFn:
    """The reward `spec` describes (validated by rlkube.lifecycle.validation); TaskError when it cannot be built."""
    if spec.type == "math":
        try:
            return MathReward(spec.answer_pattern)
        except ImportError as exc:
            raise TaskError("spec.task.reward.type", f"the math reward needs the math-verify package: {exc}") from None
    if spec.type == "exact":
        return ExactReward(spec.normalize, spec.ignore_case, spec.match, spec.answer_pattern)
    if spec.type == "regex":
        if not spec.pattern:
            raise TaskError("spec.task.reward.pattern", "required when spec.task.reward.type is regex")
        return RegexReward(spec.pattern, spec.normalize, spec.ignore_case)
    if spec.type == "python":
        if not spec.function:
            raise TaskError("spec.task.reward.function", "required when spec.task.reward.type is python")
        return PythonReward(spec.function, spec.params)
    raise TaskError("spec.task.reward.type", f"unknown reward type {spec.type!r}")
