"""`calculator`: the built-in tool-using environment, small enough for the tiny CPU model to learn.

The prompt is a sum of two small numbers, `"3+4="`. A reply containing `?` calls the calculator on that question
(the fixed, one-character call syntax: a randomly initialised model with a character vocabulary emits it by
chance a few times in a hundred, so the call is discovered); the tool answers with the result (`"7"`), and the
model's next reply must repeat it. Any other reply is the final answer. Reward: 1 for the exact result; after a
tool call, `callCredit` plus the rest scaled by per-character credit of the answer (as the digit tasks give,
rlkube.core.actor.tasks.char_match_reward), so that calling and then repeating are each worth learning on their own;
without a call, exact match only; 0 for an episode that never answers (it calls until its turns run out).
"""

from __future__ import annotations

import operator
import random
from typing import Any

from rlkube.core.actor.task_types import Message, Prompt, TaskError
from rlkube.core.actor.tasks import DIGITS, _camel_to_snake, char_match_reward

CALL = "?"
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def calculate(expression: str) -> str:
    """`a<op>b` for non-negative integers a, b and op in + - *: the result as text. ValueError otherwise."""
    for symbol, fn in OPERATIONS.items():
        left, sep, right = expression.partition(symbol)
        if sep and left.isdigit() and right.isdigit():
            return str(fn(int(left), int(right)))
    raise ValueError(f"not an expression the calculator knows: {expression!r}")


class CalculatorEpisode:
    def __init__(self, question: str, result: str, call_credit: float, kind_credit: float):
        self.question, self.result = question, result
        self.call_credit, self.kind_credit = call_credit, kind_credit
        self.called = False
        self.answer: str | None = ""

    def respond(self, reply: str) -> list[Message] | None:
        if CALL in reply:
            self.called = True
            self.answer = None
            return [{"role": "tool", "content": calculate(self.question)}]
        self.answer = reply.strip()
        return None

    def reward(self) -> float:
        if self.answer == self.result:
            return 1.0
        if not self.called or self.answer is None:
            # Never answered (still calling when the turns ran out) scores nothing: a policy that only calls
            # would otherwise earn the call's credit in every episode, equal rewards that teach nothing more.
            return 0.0
        partial = char_match_reward(self.result, self.answer, DIGITS, self.kind_credit)
        return self.call_credit + (1 - self.call_credit) * partial


class Calculator:
    """Sums of two numbers in [0, maxOperand]; a reply containing `?` calls the calculator, the next repeats it."""

    name = "calculator"
    raw_prompts = True  # `"3+4="` as it is, like the digit tasks

    def __init__(self, max_operand: int = 4, operations: str = "+", call_credit: float = 0.25,
                 kind_credit: float = 0.5):
        if isinstance(max_operand, bool) or not isinstance(max_operand, int) or not 0 <= max_operand <= 999:
            raise TaskError("spec.task.environment.params.maxOperand", f"an integer in [0, 999], got {max_operand!r}")
        if not isinstance(operations, str) or not operations or not set(operations) <= set(OPERATIONS):
            raise TaskError("spec.task.environment.params.operations", f"some of {''.join(OPERATIONS)!r}, got "
                            f"{operations!r}")
        for name, value in (("callCredit", call_credit), ("kindCredit", kind_credit)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise TaskError(f"spec.task.environment.params.{name}", f"a number in [0, 1], got {value!r}")
        self.max_operand, self.operations = max_operand, operations
        self.call_credit, self.kind_credit = float(call_credit), float(kind_credit)

    def prompt(self, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.operations)
        if op == "-" and a < b:
            a, b = b, a  # results stay non-negative: the tool's answer is digits only
        question = f"{a}{op}{b}"
        return Prompt(f"{question}=", {"answer": calculate(question), "question": question})

    def start(self, prompt: Prompt) -> CalculatorEpisode:
        return CalculatorEpisode(prompt.meta["question"], prompt.meta["answer"], self.call_credit, self.kind_credit)

    # A Task too (rlkube.core.actor.tasks.Task): `rlkube tasks` and the single-turn paths can name it.
    def reward(self, prompt: Prompt, completion: str) -> float:
        episode = self.start(prompt)
        episode.respond(completion)
        return episode.reward()

    def __repr__(self) -> str:
        return f"Calculator(max_operand={self.max_operand}, operations={self.operations!r})"


def factory(**params: Any) -> Calculator:
    try:
        return Calculator(**_camel_to_snake(params))
    except TypeError as exc:
        raise TaskError("spec.task.environment.params", f"{exc} (environment 'calculator')") from None
