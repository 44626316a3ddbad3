"""The reward verifiers on real answers: math-verify equivalence, exact match, regex/format, a user's function, and
a failing reward scored 0 and counted by the Scorer instead of raising."""

import math
import sys
import textwrap

import pytest

from rlkube.api.task import RewardSpec, TaskSpec
from rlkube.core.actor.rewards import ExactReward, MathReward, RegexReward, RewardError, build_reward, normalize
from rlkube.core.actor.tasks import Prompt, Scorer, TaskError, load_task


def p(answer=None, **meta) -> Prompt:
    return Prompt("q", {"answer": answer, **meta})


@pytest.mark.parametrize("completion", [
    "4", "\\boxed{4}", "2+2", "The answer is 4.", "$\\frac{8}{2}$", "so we get \\boxed{2 \\cdot 2}", "4.0",
])
def test_math_accepts_equivalent_answers(completion):
    assert MathReward()(p("4"), completion) == 1.0


@pytest.mark.parametrize("completion", ["5", "\\boxed{5}", "", "no idea", "2+3"])
def test_math_rejects_wrong_answers(completion):
    assert MathReward()(p("4"), completion) == 0.0


def test_math_reference_answers_in_their_usual_forms():
    reward = MathReward()
    assert reward(p(4), "4") == 1.0  # numbers from JSON
    assert reward(p("\\frac{1}{2}"), "0.5") == 1.0  # bare LaTeX reference
    assert reward(p("$\\frac{1}{2}$"), "1/2") == 1.0
    assert reward(p("\\boxed{3}"), "three is \\boxed{3}") == 1.0
    assert reward(p("1/3"), "0.5") == 0.0


def test_math_with_an_answer_pattern_reads_only_the_marked_answer():
    reward = MathReward(answer_pattern=r"####\s*(.+)")
    assert reward(p("4"), "2 and 2 make 5... no: #### 4") == 1.0
    assert reward(p("4"), "the answer is 4") == 0.0  # no `####`: no answer


def test_math_unreadable_reference_or_none_raises():
    with pytest.raises(RewardError, match="no reference answer"):
        MathReward()(p(None), "4")
    with pytest.raises(RewardError, match="cannot read the reference answer"):
        MathReward()(p("!!!"), "4")


def test_exact_normalisations_and_prefix():
    assert ExactReward()(p("Paris"), "  Paris\n") == 1.0
    assert ExactReward(normalize="none")(p("Paris"), " Paris") == 0.0
    assert ExactReward()(p("New York"), "New  York") == 0.0
    assert ExactReward(normalize="whitespace")(p("New York"), " New \n York ") == 1.0
    assert ExactReward()(p("Paris"), "paris") == 0.0
    assert ExactReward(ignore_case=True)(p("Paris"), "PARIS") == 1.0
    assert ExactReward()(p("7"), "77") == 0.0
    assert ExactReward(match="prefix")(p("7"), "77") == 1.0
    assert ExactReward(match="prefix")(p("7"), "87") == 0.0
    assert ExactReward()(p(7), "7") == 1.0  # a non-text answer compares as its text
    assert ExactReward(answer_pattern=r"<answer>(?P<answer>.*?)</answer>")(p("7"), "hmm <answer> 7 </answer>") == 1.0
    assert ExactReward(answer_pattern=r"<answer>(.*?)</answer>")(p("7"), "7") == 0.0
    assert normalize(" A \t b ", "whitespace", ignore_case=True) == "a b"


def test_regex_format_and_answer_group():
    fmt = RegexReward(r"^<think>.*</think>\s*\S", normalize="strip")
    assert fmt(p(), "<think>x</think> 42") == 1.0
    assert fmt(p(), "42") == 0.0
    both = RegexReward(r"answer: (?P<answer>\w+)$", ignore_case=True)
    assert both(p("yes"), "So the Answer: YES") == 1.0
    assert both(p("yes"), "answer: no") == 0.0
    with pytest.raises(RewardError):
        both(p(None), "answer: yes")


def test_python_reward_gets_completion_answer_sample_and_params(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        calls = []

        def length_bonus(completion, answer, sample, scale=1.0):
            calls.append((completion, answer, sample))
            return scale * (completion == answer) + 0.01 * len(completion)

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reward = build_reward(RewardSpec(type="python", function="my_rewards:length_bonus", params={"scale": 2}))
        prompt = Prompt("q", {"answer": "ab", "sample": {"prompt": "q", "answer": "ab", "id": 9}})
        assert reward(prompt, "ab") == pytest.approx(2.02)
        import my_rewards

        assert my_rewards.calls == [("ab", "ab", {"prompt": "q", "answer": "ab", "id": 9})]
        with pytest.raises(TaskError, match="spec.task.reward.function: .* not a function"):
            build_reward(RewardSpec(type="python", function="my_rewards:NOT_CALLABLE"))
        with pytest.raises(TaskError, match="spec.task.reward.function: cannot import 'no_such_mod_q'"):
            build_reward(RewardSpec(type="python", function="no_such_mod_q:f"))
        with pytest.raises(TaskError, match="spec.task.reward.function: module 'my_rewards' has no attribute 'nope'"):
            build_reward(RewardSpec(type="python", function="my_rewards:nope"))
    finally:
        sys.modules.pop("my_rewards", None)


def test_a_reward_that_raises_scores_zero_and_is_counted(tmp_path, monkeypatch, caplog):
    (tmp_path / "flaky_rewards.py").write_text(textwrap.dedent("""
        def score(completion, answer, sample):
            if completion == "boom":
                raise RuntimeError("reward service down")
            if completion == "nan":
                return float("nan")
            if completion == "text":
                return "high"
            return 0.75
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        task = load_task(TaskSpec(name="repeat-digit", reward={"type": "python", "function": "flaky_rewards:score"}))
        scorer = Scorer(task)
        prompt = Prompt("repeat 3:", {"answer": "3"})
        assert scorer(prompt, "3") == (0.75, False)
        with caplog.at_level("WARNING", logger="rlkube.tasks"):
            assert scorer(prompt, "boom") == (0.0, True)
        assert "reward service down" in caplog.text and "RuntimeError" in caplog.text
        assert scorer(prompt, "nan") == (0.0, True)  # not a finite number
        assert scorer(prompt, "text") == (0.0, True)
        assert scorer(prompt, "3") == (0.75, False)
        assert (scorer.errors, scorer.scored) == (3, 5)
    finally:
        sys.modules.pop("flaky_rewards", None)


def test_scorer_over_a_builtin_reward():
    task = load_task(TaskSpec(name="copy-digits"))
    scorer = Scorer(task)
    reward, failed = scorer(Prompt("12:", {"answer": "12"}), "12")
    assert reward == 1.0 and not failed
    reward, failed = scorer(Prompt("12:", {}), "12")  # the built-in reward reads meta["answer"]: KeyError
    assert (reward, failed, scorer.errors) == (0.0, True, 1)
    assert not math.isnan(reward)
