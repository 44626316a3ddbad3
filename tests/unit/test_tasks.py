"""Built-in tasks, their partial-credit and exact rewards, loading a task from an entry point, and rendering prompts
as plain text or through a real tokenizer's chat template."""

import json
import random
import sys
import textwrap

import pytest

from rlkube.api.task import TaskSpec
from rlkube.core.actor.tasks import (
    BUILTIN_TASKS,
    JobTask,
    Prompt,
    Task,
    TaskError,
    char_match_reward,
    load_task,
    prompt_renderer,
    render_prompt,
)


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
        from rlkube.core.actor.tasks import Prompt

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


def test_a_task_is_read_once_into_the_typed_task_the_actor_uses(tmp_path, monkeypatch):
    # A user's task with no name, no reward of its own (the spec's replaces it) and a slotted class (the loader
    # cannot set attributes on it): what it can do is read once, and the actor's renderer reads only that.
    (tmp_path / "slotted_tasks.py").write_text(textwrap.dedent("""
        from rlkube.core.actor.tasks import Prompt

        class Slotted:
            __slots__ = ()
            raw_prompts = True
            def prompt(self, rng):
                return Prompt("7:", {"answer": "7"})
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        spec = TaskSpec(name="mine", entryPoint="slotted_tasks:Slotted", reward={"type": "exact"})
        task = load_task(spec)
        assert isinstance(task, JobTask) and type(task.source).__name__ == "Slotted"
        assert (task.name, task.raw_prompts, task.needs_chat_template) == ("mine", True, None)
        assert task.reward(task.prompt(random.Random(0)), "7") == 1.0
        assert not prompt_renderer(spec, task).chat_template  # raw prompts: no template unless asked for
        assert JobTask.of(task) is task
        built_in = load_task(TaskSpec(name="copy-digits"))
        assert built_in.raw_prompts and built_in.reward is not None and built_in.name == "copy-digits"
    finally:
        sys.modules.pop("slotted_tasks", None)


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
    assert set(BUILTIN_TASKS) >= {"reverse-digits", "copy-digits", "repeat-digit"}


def test_rlkube_tasks_lists_the_builtins(capsys):
    from rlkube.cli import main

    assert main(["tasks"]) == 0
    out = capsys.readouterr().out
    assert "reverse-digits" in out and "copy-digits" in out and "maxDigits=2" in out and "entryPoint" in out
    assert "repeat-digit" in out and "'repeat {digit}:'" in out and "spec.task.dataset" in out


def test_repeat_digit_is_exact_match_on_the_named_digit():
    task = load_task(TaskSpec(name="repeat-digit"))
    rng = random.Random(0)
    prompts = [task.prompt(rng) for _ in range(200)]
    assert {p.meta["answer"] for p in prompts} == set("0123456789")
    for p in prompts[:20]:
        assert p.text == f"repeat {p.meta['answer']}:" and p.messages is None
    p = prompts[0]
    digit, other = p.meta["answer"], str((int(p.meta["answer"]) + 1) % 10)
    assert task.reward(p, digit) == 1.0 and task.reward(p, f" {digit}\n") == 1.0
    assert task.reward(p, other) == 0.0 and task.reward(p, digit * 2) == 0.0 and task.reward(p, "") == 0.0
    prefix = load_task(TaskSpec(name="repeat-digit", params={"match": "prefix", "template": "say {digit}"}))
    q = prefix.prompt(random.Random(1))
    assert q.text == f"say {q.meta['answer']}" and prefix.reward(q, q.meta["answer"] + "xyz") == 1.0
    with pytest.raises(TaskError, match="spec.task.params.template: must contain"):
        load_task(TaskSpec(name="repeat-digit", params={"template": "say it"}))
    with pytest.raises(TaskError, match="spec.task.params.match"):
        load_task(TaskSpec(name="repeat-digit", params={"match": "contains"}))
    two = load_task(TaskSpec(name="repeat-digit", params={"digits": "10"}))
    assert {two.prompt(rng).meta["answer"] for _ in range(50)} == {"0", "1"}
    with pytest.raises(TaskError, match="spec.task.params.digits"):
        load_task(TaskSpec(name="repeat-digit", params={"digits": "1a"}))


def test_a_reward_spec_replaces_a_builtin_tasks_reward():
    task = load_task(TaskSpec(name="copy-digits", reward={"type": "exact"}))
    p = task.prompt(random.Random(2))
    answer = p.meta["answer"]
    assert task.reward(p, answer) == 1.0
    assert task.reward(p, answer[:-1] + "x") == 0.0  # no partial credit: the exact reward replaced it
    assert task.name == "copy-digits" and task.raw_prompts


def test_task_errors_are_value_errors_naming_the_field():
    with pytest.raises(TaskError) as err:
        load_task(TaskSpec(name="nope"))
    assert isinstance(err.value, ValueError) and err.value.field == "spec.task.name"
    assert str(err.value).startswith("spec.task.name: unknown built-in task")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_tokenizers():
    """A real transformers tokenizer (BPE trained here on a few strings) with and without a ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["What is 2 + 2?", "repeat 7:", "You are helpful."], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    chat = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>",
                                   chat_template=CHATML)
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    return chat, plain


def test_render_through_the_chat_template(hf_tokenizers):
    chat, plain = hf_tokenizers
    text = Prompt("What is 2 + 2?", {"answer": "4"})
    assert render_prompt(text) == "What is 2 + 2?"
    assert render_prompt(text, chat) == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    msgs = Prompt("hi", {}, [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}])
    assert render_prompt(msgs, chat) == ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi"
                                         "<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(TaskError, match="spec.task.chatTemplate: .* chat messages"):
        render_prompt(msgs)
    # the rendered text tokenizes to the template's special tokens, not to their characters
    ids = chat(render_prompt(text, chat), add_special_tokens=False)["input_ids"]
    assert ids[0] == chat.convert_tokens_to_ids("<|im_start|>")


def test_prompt_renderer_follows_the_spec_flag_and_the_tokenizer(hf_tokenizers, tmp_path):
    chat, plain = hf_tokenizers
    repeat, reverse = load_task(TaskSpec(name="repeat-digit")), load_task(TaskSpec(name="reverse-digits"))
    p = Prompt("repeat 7:", {"answer": "7"})
    # unset: the template when the tokenizer has one, except for raw-text digit tasks
    assert prompt_renderer(TaskSpec(name="repeat-digit"), repeat, chat)(p).startswith("<|im_start|>user\nrepeat 7:")
    assert prompt_renderer(TaskSpec(name="repeat-digit"), repeat, plain)(p) == "repeat 7:"
    assert prompt_renderer(TaskSpec(name="repeat-digit"), repeat, None)(p) == "repeat 7:"
    assert prompt_renderer(TaskSpec(), reverse, chat)(p) == "repeat 7:"
    assert prompt_renderer(TaskSpec(chatTemplate=True), reverse, chat)(p).startswith("<|im_start|>")
    assert prompt_renderer(TaskSpec(name="repeat-digit", chatTemplate=False), repeat, chat)(p) == "repeat 7:"
    with pytest.raises(TaskError, match="spec.task.chatTemplate: is true, but the model's tokenizer has no chat"):
        prompt_renderer(TaskSpec(chatTemplate=True), reverse, plain)
    # a dataset whose prompts are chat messages needs the template: it fails at start, naming the field
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"chat": [{"role": "user", "content": "hi"}], "answer": "hi"}) + "\n")
    spec = TaskSpec(dataset={"path": str(path), "messagesField": "chat"}, reward={"type": "exact"})
    task = load_task(spec)
    assert prompt_renderer(spec, task, chat)(task.prompt(random.Random(0))).endswith("<|im_start|>assistant\n")
    with pytest.raises(TaskError, match="spec.task.dataset.messagesField: makes prompts chat messages, .* the "
                                        "model's tokenizer has no chat template"):
        prompt_renderer(spec, task, plain)
    off = TaskSpec(dataset={"path": str(path), "messagesField": "chat"}, reward={"type": "exact"}, chatTemplate=False)
    with pytest.raises(TaskError, match="spec.task.dataset.messagesField: .* spec.task.chatTemplate is false"):
        prompt_renderer(off, task, chat)
