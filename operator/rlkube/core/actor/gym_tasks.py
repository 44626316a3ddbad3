"""reasoning-gym tasks (`spec.task.reasoningGym`): prompts from one of its procedural generators, scored by the
task's own `score_answer`.

reasoning-gym (PyPI reasoning-gym, installed with the `agents` extra) generates questions with their reference
answers from a seed, so nothing is downloaded: entry `i` of a dataset built with seed `s` is the same question in
every pod. Each task knows how to score its answers (partial credit, numeric tolerance, several right answers),
which a string comparison with the reference answer would not; `score_answer(completion, entry)` is that scorer.

Prompts are drawn as the dataset tasks draw rows (rlkube.core.actor.prompt_dataset): actor replica i of R takes
positions i, i+R, i+2R, ... of one sequence, so replicas never draw the same question. A pass over `size` questions is
one dataset; pass p is built with seed `seed + p * size`, a fresh set of questions (most generators seed entry i with
seed + i, so consecutive passes do not overlap).

A missing package, an unknown task name and a config the task refuses raise TaskError naming the spec field, when
the actor starts.
"""

from __future__ import annotations

import difflib
import logging
import random
from typing import Any

from rlkube.api.task import ReasoningGymSpec
from rlkube.core.actor.task_types import Prompt, TaskError

log = logging.getLogger("rlkube.tasks")

FIELD = "spec.task.reasoningGym"


def _registry() -> dict[str, Any]:
    try:
        import reasoning_gym  # imported here: only reasoning-gym jobs need it, and it imports every generator
    except ImportError as exc:
        raise TaskError(FIELD, f"needs the reasoning-gym package, which is not installed ({exc}): install "
                        "rlkube[agents] in the actor's image") from None
    return reasoning_gym.factory.DATASETS


class ReasoningGymTask:
    """One reasoning-gym generator as a Task: `prompt(rng)` the next question, `reward` its `score_answer`."""

    raw_prompts = False  # questions in natural language: the chat template when the tokenizer has one

    def __init__(self, spec: ReasoningGymSpec, shard: tuple[int, int] = (0, 1)):
        datasets = _registry()
        if spec.name not in datasets:
            near = difflib.get_close_matches(spec.name, datasets, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else f" ({len(datasets)} tasks, e.g. " \
                f"{', '.join(sorted(datasets)[:5])})"
            raise TaskError(f"{FIELD}.name", f"unknown reasoning-gym task {spec.name!r}{hint}")
        index, replicas = shard
        if not 0 <= index < replicas:
            raise ValueError(f"shard {index} of {replicas}")
        self.spec = spec
        self.name = f"reasoning-gym/{spec.name}"
        self.index, self.replicas = index, replicas
        self.turn = 0
        self._pass: int | None = None
        self._dataset: Any = None
        self._build(0)  # a config the task refuses fails now, at start, not at the first prompt

    def _build(self, n: int) -> Any:
        if n != self._pass:
            dataset_cls, config_cls = _registry()[self.spec.name]
            config = {key: list(v) if isinstance(v, list) else v for key, v in self.spec.config.items()}
            for reserved in ("seed", "size"):
                if reserved in config:
                    raise TaskError(f"{FIELD}.config.{reserved}", f"set spec.task.reasoningGym.{reserved} instead")
            try:
                cfg = config_cls(**config, seed=self.spec.seed + n * self.spec.size, size=self.spec.size)
                if hasattr(cfg, "validate"):
                    cfg.validate()
                self._dataset = dataset_cls(config=cfg)
            except (TypeError, ValueError, AssertionError) as exc:
                raise TaskError(f"{FIELD}.config", f"reasoning-gym task {self.spec.name!r} refuses {config}: "
                                f"{type(exc).__name__}: {exc}") from None
            self._pass = n
        return self._dataset

    def prompt(self, rng: random.Random | None = None) -> Prompt:
        """The next question of this replica's sequence (`rng` is unused: the order is the seed's)."""
        position = self.turn * self.replicas + self.index
        self.turn += 1
        n, offset = divmod(position, self.spec.size)
        dataset = self._build(n)
        entry = dataset[offset]
        return Prompt(entry["question"], {"answer": entry["answer"], "sample": entry, "entry": entry,
                                          "dataset": dataset})

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The task's own scorer, on the completion as the model wrote it (trimmed)."""
        return float(prompt.meta["dataset"].score_answer(completion.strip(), prompt.meta["entry"]))

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.spec.name!r}, seed={self.spec.seed}, size={self.spec.size})"


def load(spec: ReasoningGymSpec, shard: tuple[int, int] = (0, 1)) -> ReasoningGymTask:
    return ReasoningGymTask(spec, shard)
