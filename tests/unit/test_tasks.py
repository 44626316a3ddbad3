"""Built-in tasks, their partial-credit reward, and loading a task from an entry point."""

import random
import sys
import textwrap

import pytest

from rlkube.api.spec import TaskSpec
from rlkube.core.tasks import BUILTIN_TASKS, Prompt, Task, char_match_reward, load_task


def test_reverse_digits_prompt_and_answer():
    task = load_task(TaskSpec(name="reverse-digits", params={"minDigits": 3, "maxDigits": 3}))
    p = task.prompt(random.Random(7))
    digits = p.text[:-1]
    assert p.text.endswith(":") and len(digits) == 3 and digits.isdigit()
    assert p.meta["answer"] == digits[::-1]
    assert task.reward(p, digits[::-1]) == 1.0


def test_copy_digits():
    task = load_task(TaskSpec(name="copy-digits"))
    p = task.prompt(random.Random(1))
    assert p.meta["answer"] == p.text[:-1]
    assert task.name == "copy-digits"


def test_partial_credit_by_hand():
    # answer "21": right char 1.0, digit in the wrong place kind_credit, other char 0; / max(len) penalises extras
    assert char_match_reward("21", "21") == 1.0
    assert char_match_reward("21", "2") == pytest.approx(0.5)
    assert char_match_reward("21", "25", kind_credit=0.5) == pytest.approx((1 + 0.5) / 2)
    assert char_match_reward("21", "2a", kind_credit=0.5) == pytest.approx(0.5)
    assert char_match_reward("21", "2100") == pytest.approx(2 / 4)
    assert char_match_reward("21", "") == 0.0
    assert char_match_reward("21", "xyz") == 0.0


def test_prompts_are_deterministic_per_seed_and_varied():
    task = load_task(TaskSpec())
    a = [task.prompt(random.Random(3)).text for _ in range(2)]
    assert a[0] == a[1]
    rng = random.Random(0)
    assert len({task.prompt(rng).text for _ in range(50)}) > 20


def test_rewards_stay_in_unit_interval():
    task = load_task(TaskSpec())
    rng = random.Random(0)
    for _ in range(200):
        p = task.prompt(rng)
        completion = "".join(rng.choice("0123456789ab") for _ in range(rng.randint(0, 6)))
        assert 0.0 <= task.reward(p, completion) <= 1.0


def test_entry_point_task(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(textwrap.dedent("""
        from rlkube.core.tasks import Prompt

        class Echo:
            name = "echo"
            def __init__(self, word):
                self.word = word
            def prompt(self, rng):
                return Prompt(self.word + ":", {"answer": self.word})
            def reward(self, prompt, completion):
                return float(completion == prompt.meta["answer"])

        def make(word="abc"):
            return Echo(word)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        task = load_task(TaskSpec(name="mine", entryPoint="my_tasks:make", params={"word": "hi"}))
        assert isinstance(task, Task)
        p = task.prompt(random.Random(0))
        assert p == Prompt("hi:", {"answer": "hi"})
        assert task.reward(p, "hi") == 1.0 and task.reward(p, "ho") == 0.0
    finally:
        sys.modules.pop("my_tasks", None)


def test_bad_task_specs_name_the_field():
    with pytest.raises(ValueError, match="spec.task.name: unknown built-in task 'nope'"):
        load_task(TaskSpec(name="nope"))
    with pytest.raises(ValueError, match="spec.task.entryPoint: cannot import 'no_such_module_xyz'"):
        load_task(TaskSpec(entryPoint="no_such_module_xyz:make"))
    with pytest.raises(ValueError, match="has no attribute 'nothing'"):
        load_task(TaskSpec(entryPoint="random:nothing"))
    with pytest.raises(ValueError, match="spec.task.params.maxDigits"):
        load_task(TaskSpec(params={"maxDigits": 0}))
    with pytest.raises(ValueError, match="spec.task.params"):
        load_task(TaskSpec(params={"colour": "red"}))
    with pytest.raises(ValueError, match="has no prompt"):
        load_task(TaskSpec(entryPoint="builtins:dict"))
    assert set(BUILTIN_TASKS) >= {"reverse-digits", "copy-digits"}


def test_rlkube_tasks_lists_the_builtins(capsys):
    from rlkube.cli import main

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "reverse-digits" in out and "copy-digits" in out and "maxDigits=2" in out and "entryPoint" in out
