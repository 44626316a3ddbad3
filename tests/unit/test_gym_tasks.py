"""reasoning-gym tasks (spec.task.reasoningGym, rlkube.core.actor.gym_tasks): prompts from the real generators, rewards
from their own score_answer, replicas drawing disjoint questions, and errors that name the spec field."""

from __future__ import annotations

import random
import sys

import pytest

from rlkube.api.spec import TrainingJobSpec
from rlkube.api.task import TaskSpec
from rlkube.core.actor.tasks import Scorer, load_task
from rlkube.core.actor.task_types import TaskError
from rlkube.lifecycle.validation import task_errors

reasoning_gym = pytest.importorskip("reasoning_gym")  # the `agents` extra

ARITHMETIC = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1,
                                                     "operators": ["+"], "allow_parentheses": False,
                                                     "allow_negation": False}, "seed": 5, "size": 7}


def task_spec(**gym) -> TaskSpec:
    return TaskSpec.model_validate({"name": "gym", "reasoningGym": {**ARITHMETIC, **gym}})


def test_prompts_are_the_generators_questions_and_rewards_its_scorer():
    task = load_task(task_spec())
    reference = reasoning_gym.create_dataset("basic_arithmetic", **ARITHMETIC["config"], seed=5, size=7)
    rng = random.Random(0)
    for i in range(7):
        prompt = task.prompt(rng)
        entry = reference[i]
        assert prompt.text == entry["question"] and prompt.meta["answer"] == entry["answer"]
        a, b = (int(x) for x in entry["question"].removeprefix("Calculate ").rstrip(".").split(" + "))
        assert int(entry["answer"]) == a + b  # one-digit sums, as configured
        assert task.reward(prompt, entry["answer"]) == 1.0
        assert task.reward(prompt, f" {entry['answer']}\n") == 1.0  # trimmed
        # The task's own partial credit: the answer inside a longer reply scores its share of the reply.
        assert task.reward(prompt, f"{entry['answer']}xy") == pytest.approx(len(entry["answer"]) /
                                                                            (len(entry["answer"]) + 2))
        assert task.reward(prompt, "no") == 0.0


def test_a_config_list_reaches_the_generator():
    task = load_task(task_spec(config={**ARITHMETIC["config"], "operators": ["*"]}, size=20))
    texts = [task.prompt(random.Random(0)).text for _ in range(20)]
    assert all(" * " in t and " + " not in t for t in texts), texts


def test_replicas_draw_disjoint_questions_and_a_new_pass_is_reseeded():
    spec = task_spec(name="spell_backward", config={}, seed=0, size=5)
    one, two = load_task(spec, shard=(0, 2)), load_task(spec, shard=(1, 2))
    rng = random.Random(0)
    first = [one.prompt(rng).meta["entry"] for _ in range(5)]
    second = [two.prompt(rng).meta["entry"] for _ in range(5)]
    # Together the replicas walk positions 0..9: pass 0 (seed 0) then pass 1 (seed 0 + 5).
    pass0 = reasoning_gym.create_dataset("spell_backward", seed=0, size=5)
    pass1 = reasoning_gym.create_dataset("spell_backward", seed=5, size=5)
    walked = [e for pair in zip(first, second) for e in pair]
    assert [e["question"] for e in walked] == [pass0[i]["question"] for i in range(5)] + \
        [pass1[i]["question"] for i in range(5)]
    assert len({e["question"] for e in walked}) == 10


def test_scorer_reports_the_reward_through_the_actors_scorer():
    task = load_task(task_spec())
    prompt = task.prompt(random.Random(0))
    assert Scorer(task)(prompt, prompt.meta["answer"]) == (1.0, False)


@pytest.mark.parametrize(("gym", "field", "words"), [
    ({"name": "basic_arithmetc"}, "spec.task.reasoningGym.name", "did you mean basic_arithmetic"),
    ({"name": "no_such_thing_at_all"}, "spec.task.reasoningGym.name", "unknown reasoning-gym task"),
    ({"config": {"bogus": 1}}, "spec.task.reasoningGym.config", "unexpected keyword argument 'bogus'"),
    ({"config": {"min_terms": 3, "max_terms": 2}}, "spec.task.reasoningGym.config", "max_terms must be >= min_terms"),
    ({"config": {"seed": 3}}, "spec.task.reasoningGym.config.seed", "set spec.task.reasoningGym.seed instead"),
])
def test_bad_input_names_the_field(gym, field, words):
    with pytest.raises(TaskError) as err:
        load_task(task_spec(**gym))
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_missing_package_names_the_field_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises ImportError
    with pytest.raises(TaskError) as err:
        load_task(task_spec())
    assert err.value.field == "spec.task.reasoningGym" and "rlkube[agents]" in str(err.value)


def test_validation_refuses_a_second_prompt_source():
    assert task_errors(task_spec()) == []
    for extra, field in (({"entryPoint": "pkg.mod:make"}, "spec.task.entryPoint"),
                         ({"params": {"x": 1}}, "spec.task.params"),
                         ({"dataset": {"path": "/d.jsonl"}, "reward": {"type": "exact"}}, "spec.task.dataset")):
        spec = TaskSpec.model_validate({"reasoningGym": ARITHMETIC, **extra})
        assert [e.field for e in task_errors(spec)] == [field], extra
    job = TrainingJobSpec.model_validate({"model": {"path": "builtin://tiny-llama"}, "algorithm": {"maxSteps": 1},
                                          "task": {"reasoningGym": ARITHMETIC}})
    assert job.task.reasoning_gym.config["operators"] == ["+"]
