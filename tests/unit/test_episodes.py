"""Multi-turn episodes (rlkube.core.actor.episodes) from the engine's replies to the trainer's documents: exact tokens,
environment turns out of the loss, per-token versions; a hanging tool, a failing one and the limits; the built-in
calculator; the environment loader's errors naming the spec field."""

from __future__ import annotations

import asyncio
import random
import sys
import textwrap
import threading

import numpy as np
import pytest

from rlkube.api.task import EnvironmentSpec, TaskSpec
from rlkube.contract import protocol
from rlkube.core.training.batch import collate
from rlkube.core.actor.calculator import Calculator, calculate
from rlkube.core.actor.environments import load_environment
from rlkube.core.actor.episodes import (Limits, MessageEncoder, Reply, SampleRefused, Turn, call_with_timeout,
                                        run_episode)
from rlkube.core.hf.builtin import char_tokenizer
from rlkube.core.training.losses import LossConfig, policy_loss
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
from rlkube.core.actor.task_types import TaskError

TOK = char_tokenizer()


class FakeEngine:
    """Samples random ids (from a few fixed replies' ids, so the calculator sees calls and answers), records every
    request and reply, and reports a version that moves on every call (turns straddling weight updates)."""

    def __init__(self, replies: list[str], seed: int = 0):
        self.rng = random.Random(seed)
        self.replies = replies
        self.version = 3
        self.log: list[tuple[list[int], Reply]] = []

    def reply(self, prompt_ids: list[int], max_tokens: int) -> Reply:
        text = self.rng.choice(self.replies)
        ids = list(TOK(text, add_special_tokens=False)["input_ids"])[:max_tokens]
        if len(ids) < max_tokens:
            ids.append(TOK.eos_token_id)
        reply = Reply(token_ids=ids, logprobs=[-self.rng.random() - 0.01 for _ in ids], version=self.version,
                      finished=ids[-1] == TOK.eos_token_id, prompt_ids=list(prompt_ids))
        self.log.append((list(prompt_ids), reply))
        self.version += self.rng.choice((0, 1))
        return reply

    async def sample(self, prompt_ids: list[int], max_tokens: int) -> Reply:
        return self.reply(prompt_ids, max_tokens)


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=True)


def play_group(env, engine: FakeEngine, limits: Limits, n: int = 6, max_new: int = 3, seed: int = 0):
    prompt = env.prompt(random.Random(seed))
    prompt_ids = TOK(prompt.text)["input_ids"]
    encoder = MessageEncoder(TOK, chat_template=False)

    async def play():
        firsts = [engine.reply(prompt_ids, max_new) for _ in range(n)]
        return await asyncio.gather(*(run_episode(env.start(prompt), f, engine.sample, encoder, decode, limits, max_new)
                                      for f in firsts))

    return prompt, asyncio.run(play())


def as_group(results) -> protocol.RolloutGroup:
    samples = [protocol.Sample(completion_tokens=r.tokens, logprobs=r.logprobs, reward=r.reward,
                               env_spans=r.env_spans, versions=r.versions, episode={"turns": r.turns})
               for r in results]
    return protocol.RolloutGroup("g", results[0].prompt_ids, samples, min(min(r.versions) for r in results), len(samples))


def test_documents_are_the_sampled_ids_and_the_appended_environment_ids_in_order():
    engine = FakeEngine(["?", "?", "7", "3", "12", "?x"], seed=1)
    prompt, results = play_group(Calculator(max_operand=4), engine, Limits(max_turns=4, max_episode_tokens=40))
    group = protocol.RolloutGroup.decode(as_group(results).encode())  # through the wire format
    docs = [protocol.decode_document(protocol.encode_document(d))
            for d in group_to_documents(group, DocumentConfig())]
    assert len(docs) == 6 and any(r.turns > 1 for r in results) and any(r.tool_calls for r in results)
    replies: dict[tuple[int, ...], list[Reply]] = {}
    for p, r in engine.log:
        replies.setdefault(tuple(p), []).append(r)
    tool_ids = TOK(calculate(prompt.meta["question"]), add_special_tokens=False)["input_ids"]
    for doc, result in zip(docs, results, strict=True):
        tokens = doc.tokens.tolist()
        mask = doc.loss_mask()
        n_prompt = len(result.prompt_ids)
        assert tokens[:n_prompt] == TOK(prompt.text)["input_ids"] and not mask[:n_prompt].any()
        # Walk the document: every trained span is one engine reply to exactly the tokens before it, with its
        # log-probs and version; every span between replies is the calculator's answer, outside the loss.
        at, sampled, env = n_prompt, 0, 0
        while at < len(tokens):
            # The engine's replies to these exact tokens (the group's first turns share a prompt): one is this span.
            reply = next(r for r in replies[tuple(tokens[:at])]
                         if tokens[at:at + len(r.token_ids)] == r.token_ids
                         and np.allclose(doc.old_log_probabilities[at:at + len(r.token_ids)], r.logprobs, rtol=1e-6)
                         and doc.model_version[at:at + len(r.token_ids)].tolist() == [r.version] * len(r.token_ids))
            end = at + len(reply.token_ids)
            assert mask[at:end].all()
            sampled += 1
            at = end
            if at < len(tokens):
                assert tokens[at:at + len(tool_ids)] == tool_ids and not mask[at:at + len(tool_ids)].any()
                assert (doc.old_log_probabilities[at:at + len(tool_ids)] == 0).all()
                at += len(tool_ids)
                env += 1
        assert (sampled, env) == (result.turns, result.tool_calls)


def test_environment_tokens_get_no_gradient():
    engine = FakeEngine(["?"], seed=2)  # every reply calls the tool: every episode has environment spans
    _, results = play_group(Calculator(), engine, Limits(max_turns=3), n=2)
    results[0].reward, results[1].reward = 1.0, 0.0
    docs = group_to_documents(as_group(results), DocumentConfig())
    batch = collate(docs)
    new_logp = batch.old_logprobs.clone().requires_grad_()  # ratio 1: no token is clipped
    out = policy_loss(new_logp, batch.old_logprobs, batch.advantages, batch.loss_mask, LossConfig())
    out.loss.backward()
    for i, doc in enumerate(docs):
        env = np.zeros(len(doc.tokens), dtype=bool)
        for b, e in results[i].env_spans:
            env[len(results[i].prompt_ids) + b:len(results[i].prompt_ids) + e] = True
        assert env.any()
        targets = env[1:]  # row t of the batch predicts token t + 1
        grad = new_logp.grad[i, : len(doc.tokens) - 1].numpy()
        assert (grad[targets] == 0).all()
        assert (grad[~targets & batch.loss_mask[i, : len(doc.tokens) - 1].numpy()] != 0).all()


class Hangs:
    """The first episode's tool blocks until released; the others answer at once."""

    name = "hangs"

    def __init__(self):
        self.release = threading.Event()
        self.started = 0
        self.scored = 0

    def start(self, prompt):
        self.started += 1
        env, first = self, self.started == 1

        class Episode:
            def respond(self, reply):
                if first:
                    env.release.wait()
                return None

            def reward(self):
                env.scored += 1
                return 0.5

        return Episode()


def test_a_hanging_tool_is_timed_out_scored_and_counted_and_the_next_episode_runs():
    env = Hangs()
    limits = Limits(max_turns=3, tool_timeout_s=0.3)
    encoder = MessageEncoder(TOK, chat_template=False)
    engine = FakeEngine(["1"])

    async def play():
        prompt_ids = TOK("1+1=")["input_ids"]
        first = await run_episode(env.start(None), engine.reply(prompt_ids, 2), engine.sample, encoder, decode,
                                  limits, 2)
        second = await run_episode(env.start(None), engine.reply(prompt_ids, 2), engine.sample, encoder, decode,
                                   limits, 2)
        return first, second

    try:
        first, second = asyncio.run(play())
    finally:
        env.release.set()
    assert (first.tool_timeouts, first.reward, first.turns) == (1, 0.5, 1)
    assert (second.tool_timeouts, second.reward) == (0, 0.5)
    assert env.scored == 2


def test_call_with_timeout_does_not_use_up_the_loop_s_threads():
    release = threading.Event()

    async def many():
        hung = [call_with_timeout(release.wait, timeout=0.2) for _ in range(40)]  # more than any default pool
        results = await asyncio.gather(*hung, return_exceptions=True)
        return results, await call_with_timeout(lambda: 42, timeout=1)

    try:
        results, value = asyncio.run(many())
    finally:
        release.set()
    assert all(type(r).__name__ == "ToolTimeout" for r in results) and value == 42


class Chatty:
    """Answers every reply with `words` characters; scores 1; `raises` makes respond fail."""

    name = "chatty"

    def __init__(self, words: int = 4, raises: bool = False):
        self.words, self.raises = words, raises

    def start(self, prompt):
        env = self

        class Episode:
            def respond(self, reply):
                if env.raises:
                    raise RuntimeError("tool crashed")
                return [{"role": "tool", "content": "a" * env.words}]

            def reward(self):
                return 1.0

        return Episode()


def _play(env, limits, max_new=2):
    engine = FakeEngine(["12"])
    encoder = MessageEncoder(TOK, chat_template=False)
    prompt_ids = TOK("1+1=")["input_ids"]
    return asyncio.run(run_episode(env.start(None), engine.reply(prompt_ids, max_new), engine.sample, encoder, decode,
                                   limits, max_new))


def test_an_episode_over_its_token_budget_is_truncated_and_counted():
    result = _play(Chatty(words=4), Limits(max_turns=50, max_episode_tokens=20))
    assert result.truncated and result.reward == 1.0
    assert result.length <= 20
    assert result.turns >= 2  # it ran until the next answer would not fit


def test_an_episode_out_of_turns_is_truncated():
    result = _play(Chatty(words=1), Limits(max_turns=3))
    assert result.truncated and result.turns == 3 and result.tool_calls == 2


def test_a_tool_that_raises_ends_the_episode_as_a_tool_error():
    result = _play(Chatty(raises=True), Limits(max_turns=3))
    assert (result.tool_errors, result.turns, result.truncated, result.reward) == (1, 1, False, 1.0)


def test_a_refused_next_turn_truncates_the_episode():
    engine = FakeEngine(["12"])

    async def refuse(ids, max_tokens):
        raise SampleRefused("too long")

    prompt_ids = TOK("1+1=")["input_ids"]
    result = asyncio.run(run_episode(Chatty().start(None), engine.reply(prompt_ids, 2), refuse,
                                     MessageEncoder(TOK, False), decode, Limits(), 2))
    assert result.truncated and result.tool_calls == 1 and result.env_spans


def test_the_chat_template_renders_only_the_new_messages():
    from support.hf_models import bpe_tokenizer

    qwen = bpe_tokenizer()
    encoder = MessageEncoder(qwen, chat_template=True)
    assert encoder.closing == "<|im_end|>\n"  # what Qwen's template writes after a reply's content
    # After a reply that ended with its stop token <|im_end|>, the template's newline, then the new turn only:
    ids = encoder([{"role": "tool", "content": "7"}], stop_token=qwen.eos_token_id)
    assert qwen.decode(ids) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    # After a reply cut by max_tokens, the whole closing (the model never sampled <|im_end|>):
    ids = encoder([{"role": "tool", "content": "7"}])
    assert qwen.decode(ids) == "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    char = MessageEncoder(TOK, chat_template=True)([{"role": "tool", "content": "7"}])
    assert char == TOK("7", add_special_tokens=False)["input_ids"]  # no second <bos>


def test_calculator_rewards():
    calc = Calculator(max_operand=4)
    prompt = calc.prompt(random.Random(3))
    result = prompt.meta["answer"]
    assert prompt.text == prompt.meta["question"] + "=" and result == calculate(prompt.meta["question"])
    ep = calc.start(prompt)
    assert ep.respond("?") == [{"role": "tool", "content": result}]
    assert ep.respond(result) is None and ep.reward() == 1.0
    ep = calc.start(prompt)
    ep.respond("?")
    ep.respond("x")
    assert ep.reward() == 0.25  # the call's credit, nothing for the answer
    ep = calc.start(prompt)
    ep.respond("x")
    assert ep.reward() == 0.0
    ep = calc.start(prompt)
    ep.respond("?")
    ep.respond("??")  # still calling when the turns ran out: never answered
    assert ep.reward() == 0.0
    assert calculate("12*3") == "36" and calculate("7-2") == "5"
    with pytest.raises(ValueError):
        calculate("1+x")


def test_environment_loader_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent("""
        def broken(**params):
            raise RuntimeError("no sandbox here")

        def not_an_env(**params):
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_envs", None)

    def load(**env):
        return load_environment(TaskSpec(environment=EnvironmentSpec(**env)))

    assert isinstance(load(name="calculator", params={"maxOperand": 3}), Calculator)
    cases = [
        ({"entry_point": "my_envs:broken"}, "spec.task.environment.entryPoint: the environment factory raised "
                                            "RuntimeError: no sandbox here"),
        ({"entry_point": "my_envs:not_an_env"}, "spec.task.environment.entryPoint: the factory returned 3"),
        ({"entry_point": "no_such_module_xyz:f"}, "spec.task.environment.entryPoint: cannot import"),
        ({"name": "calculator", "params": {"maxOperand": -1}}, "spec.task.environment.params.maxOperand"),
        ({"name": "calculator", "params": {"nope": 1}}, "spec.task.environment.params"),
    ]
    for env, message in cases:
        with pytest.raises(TaskError) as err:
            load(**env)
        assert str(err.value).startswith(message), (env, str(err.value))
    # A name that is no built-in never reaches the loader: the type (and the CRD's enum) refuses it.
    with pytest.raises(ValueError, match="Input should be 'calculator' or 'verifiers'"):
        EnvironmentSpec(name="chess")


def test_an_entry_point_environment_that_draws_its_own_prompts_takes_no_other_source(tmp_path, monkeypatch):
    """Only building an entryPoint environment tells whether it draws its own prompts (validation refuses a built-in
    one with another source): the actor refuses at start (TaskError: exit 78), naming both fields, before any
    episode; one that takes the task's prompts goes with a task's source."""
    (tmp_path / "prompt_envs.py").write_text(textwrap.dedent("""
        class Own:
            def prompt(self, rng):
                return None

            def start(self, prompt):
                return None


        class Theirs:
            def start(self, prompt):
                return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("prompt_envs", None)
    gym = {"name": "basic_arithmetic"}
    with pytest.raises(TaskError) as err:
        load_environment(TaskSpec(environment=EnvironmentSpec(entry_point="prompt_envs:Own"), reasoning_gym=gym))
    assert str(err.value) == ("spec.task.environment.entryPoint: 'prompt_envs:Own' draws its own prompts (it has "
                              "prompt()) and spec.task.reasoningGym is set too: set one prompt source")
    assert load_environment(TaskSpec(environment=EnvironmentSpec(entry_point="prompt_envs:Own"))) is not None
    assert load_environment(TaskSpec(environment=EnvironmentSpec(entry_point="prompt_envs:Theirs"),
                                     reasoning_gym=gym)) is not None


def test_an_answer_that_is_not_messages_is_a_tool_error():
    class Sloppy:
        name = "sloppy"

        def start(self, prompt):
            class Episode:
                def respond(self, reply):
                    return "7"  # a string, not [{role, content}]

                def reward(self):
                    return 0.0

            return Episode()

    result = _play(Sloppy(), Limits(max_turns=3))
    assert (result.tool_errors, result.tool_calls, result.turns, result.env_spans) == (1, 0, 1, [])


def test_per_token_versions_from_the_engine_s_version_spans():
    from rlkube.core.actor.inference_client import token_versions

    assert token_versions([[0, 3], [2, 4]], 4) == [3, 3, 4, 4]
    assert token_versions([[0, 5]], 2) == [5, 5]
    assert token_versions(None, 2) is None and token_versions([[1, 3]], 2) is None
    assert token_versions([[0, 3], [5, 4]], 3) is None  # a span past the tokens: malformed, not guessed


class OneToolCall:
    """Answers the first reply with a tool message, then ends."""

    def __init__(self):
        self.calls = 0

    def respond(self, reply: str):
        self.calls += 1
        return [{"role": "tool", "content": "7"}] if self.calls == 1 else None

    def reward(self) -> float:
        return 1.0


def _chat_episode(tok, replies: list[str], eos: bool):
    """One episode as the actor plays it with a chat template: the prompt rendered by the template, each reply
    the engine's ids (ending in the eos <|im_end|> when `eos`), the tool's turn appended by MessageEncoder."""
    from rlkube.core.actor.task_types import Prompt

    prompt = Prompt("1+6=", messages=[{"role": "user", "content": "1+6="}])
    prompt_ids = tok(tok.apply_chat_template([dict(m) for m in prompt.messages], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"]
    turns = iter(replies)

    def reply(ids: list[int]) -> Reply:
        out = list(tok(next(turns), add_special_tokens=False)["input_ids"]) + ([tok.eos_token_id] if eos else [])
        return Reply(token_ids=out, logprobs=[-0.5] * len(out), version=1, finished=eos, prompt_ids=list(ids))

    async def sample(ids: list[int], max_tokens: int) -> Reply:
        return reply(ids)

    encoder = MessageEncoder(tok, chat_template=True)
    result = asyncio.run(run_episode(OneToolCall(), reply(prompt_ids), sample, encoder,
                                     lambda ids: tok.decode(ids, skip_special_tokens=True), Limits(), 8))
    return encoder, prompt, result


# A template that renders a turn the same whether more follow or not (no separator after <|im_end|>).
PLAIN_TURNS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_drift_is_none_where_the_whole_conversation_renders_as_sampled():
    from support.hf_models import bpe_tokenizer

    tok = bpe_tokenizer()
    tok.chat_template = PLAIN_TURNS
    encoder, prompt, result = _chat_episode(tok, ["?", "7"], eos=True)
    assert result.tool_calls == 1 and result.turns == 2
    assert [m["role"] for m in result.messages] == ["assistant", "tool", "assistant"]
    assert encoder.rerender(prompt, result) == result.prompt_ids + result.tokens
    assert not encoder.drifted(prompt, result)


@pytest.mark.parametrize("eos", [True, False])
def test_qwen_episodes_are_the_template_s_rendering_of_the_conversation(eos):
    """Qwen's template writes a newline after every <|im_end|>: it opens the environment's span (not trained on),
    so the exact ids equal the whole conversation rendered at once, whether a reply stopped on <|im_end|> or was
    cut by max_tokens (then the environment's span closes the turn)."""
    from support.hf_models import bpe_tokenizer

    tok = bpe_tokenizer()  # Qwen's chat template
    encoder, prompt, result = _chat_episode(tok, ["?", "7"], eos=eos)
    exact = result.prompt_ids + result.tokens
    again = encoder.rerender(prompt, result)
    # The whole rendering also closes the last reply; the episode ends where sampling ended.
    assert again[:len(exact)] == exact and tok.decode(again[len(exact):]) == ("\n" if eos else "<|im_end|>\n")
    assert not encoder.drifted(prompt, result)
    (begin, end), = result.env_spans
    assert tok.decode(result.tokens[begin:end]).startswith("\n<|im_start|>tool" if eos else "<|im_end|>\n")


def test_a_chat_template_changed_mid_run_is_caught():
    from support.hf_models import bpe_tokenizer

    tok = bpe_tokenizer()
    tok.chat_template = PLAIN_TURNS
    encoder, prompt, result = _chat_episode(tok, ["?", "7"], eos=True)
    assert not encoder.drifted(prompt, result)
    tok.chat_template = PLAIN_TURNS.replace("}}\n{{", "}}: {{")  # the template changes (a new model revision)
    assert encoder.drifted(prompt, result)


def test_without_a_template_a_reply_s_stop_token_lost_on_re_rendering_is_drift():
    prompt = Calculator().prompt(random.Random(0))
    engine = FakeEngine(["?", "7"])

    def episode(finish: bool):
        first = engine.reply(TOK(prompt.text)["input_ids"], 1 if not finish else 3)
        if not finish:
            first.token_ids, first.finished = first.token_ids[:1], False
        return asyncio.run(run_episode(OneToolCall(), first, engine.sample, MessageEncoder(TOK, False), decode,
                                       Limits(), 1))

    plain = MessageEncoder(TOK, chat_template=False)
    cut = episode(finish=False)  # replies cut by max_tokens: text re-tokenizes to the same characters
    assert not plain.drifted(prompt, cut)
    stopped = episode(finish=True)  # the first reply ended with <eos>, which decoded text drops
    assert TOK.eos_token_id in stopped.tokens
    assert plain.drifted(prompt, stopped)


class Slow:
    """Answers every reply after `delay` seconds; scores 0.25 (called even after the episode's time limit)."""

    name = "slow"

    def __init__(self, delay: float):
        self.delay = delay
        self.scored = 0

    def start(self, prompt):
        env = self

        class Episode:
            def respond(self, reply):
                threading.Event().wait(env.delay)
                return [{"role": "tool", "content": "a"}]

            def reward(self):
                env.scored += 1
                return 0.25

        return Episode()


def test_an_episode_over_its_time_limit_is_ended_scored_and_counted_and_the_next_runs():
    env = Slow(delay=0.2)
    limits = Limits(max_turns=100, tool_timeout_s=5, episode_timeout_s=0.7)
    first = _play(env, limits)
    assert first.timed_out and first.truncated and first.reward == 0.25 and not first.reward_error
    assert 2 <= first.turns <= 5 and first.tool_timeouts == 0  # cut by the episode's limit, not a tool's
    # It ends on the model's turn: an answer that no reply followed is not kept.
    assert first.env_spans[-1][1] < len(first.tokens) and first.messages[-1]["role"] == "assistant"
    second = _play(Chatty(words=1), Limits(max_turns=3, episode_timeout_s=30))
    assert not second.timed_out and second.turns == 3 and env.scored == 1


def test_per_turn_rewards_are_kept_and_summed_only_when_asked():
    class Rewarding:
        name = "rewarding"

        def start(self, prompt):
            class Episode:
                n = 0

                def respond(self, reply):
                    self.n += 1
                    return Turn([{"role": "tool", "content": "a"}] if self.n < 3 else None, reward=0.1 * self.n)

                def reward(self):
                    return 1.0

            return Episode()

    final = _play(Rewarding(), Limits(max_turns=10))
    summed = _play(Rewarding(), Limits(max_turns=10, sum_turn_rewards=True))
    assert final.turn_rewards == pytest.approx([0.1, 0.2, 0.3]) and final.reward == 1.0
    assert summed.turn_rewards == final.turn_rewards and summed.reward == pytest.approx(1.6)


def test_a_factory_asking_for_the_sandbox_gets_the_job_s(tmp_path, monkeypatch):
    (tmp_path / "code_envs.py").write_text(textwrap.dedent("""
        class Env:
            name = "code"

            def __init__(self, sandbox, level):
                self.sandbox, self.level = sandbox, level

            def start(self, prompt):
                return None


        def make(sandbox, level=1):
            return Env(sandbox, level)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("code_envs", None)
    spec = EnvironmentSpec(entry_point="code_envs:make", params={"level": 2},
                           sandbox={"timeoutSeconds": 3, "cpuSeconds": 2, "memoryMib": 256})
    env = load_environment(TaskSpec(environment=spec))
    assert env.level == 2 and env.sandbox.limits.timeout_s == 3 and env.sandbox.limits.memory_mb == 256
    with pytest.raises(TaskError) as err:
        load_environment(TaskSpec(environment=EnvironmentSpec(entry_point="code_envs:make",
                                                              params={"sandbox": 1})))
    assert str(err.value).startswith("spec.task.environment.params.sandbox")
