"""A verifiers (0.4.0) taskset, written here against verifiers' public API, runs unchanged through rlkube's episode
interface (rlkube.core.actor.verifiers_env): verifiers' loader finds it by id, its tools answer the model's tool calls,
its @vf.stop hook ends episodes, its @vf.reward/@vf.metric score the vf.Trace the replies were committed to; the
episode is the engine's ids and the tool turns' ids in order, with no drift against the chat template."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import textwrap

import pytest

from rlkube.api.task import EnvironmentSpec, TaskSpec
from rlkube.contract import protocol
from rlkube.core.actor.environments import load_environment
from rlkube.core.actor.episodes import Limits, MessageEncoder, Reply, run_episode
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
from rlkube.core.actor.task_types import TaskError
from rlkube.core.actor.tasks import render_prompt

pytest.importorskip("verifiers")  # the `agents` extra

TASKSET = textwrap.dedent('''
    """A small verifiers taskset: sums with an adder tool; the answer must be the sum."""
    import verifiers.v1 as vf

    __all__ = ["SumTaskset"]


    class SumConfig(vf.TasksetConfig):
        count: int = 3


    class SumData(vf.TaskData):
        answer: str = ""


    class Adder(vf.Toolset):
        @vf.tool
        async def add(self, a: int, b: int) -> str:
            """Add two integers."""
            if a < 0:
                raise RuntimeError("the adder is broken for negative numbers")
            return str(a + b)


    class SumTask(vf.Task[SumData]):
        @vf.reward
        async def correct(self, task, trace) -> float:
            return float(trace.last_reply == task.answer)

        @vf.metric
        async def tool_uses(self, trace) -> float:
            return float(len(trace.tool_messages))

        @vf.stop
        async def gave_up(self, trace: vf.Trace) -> bool:
            return "give up" in trace.last_reply

        @classmethod
        def toolsets(cls, config):
            return [Adder(vf.ToolsetConfig())]


    class SumTaskset(vf.Taskset[SumTask, SumConfig]):
        def load(self):
            for a in range(self.config.count):
                yield SumTask(SumData(prompt=f"What is {a} + 4?", answer=str(a + 4), system_prompt="Add."))
''')


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Nothing here may reach the network (verifiers fetches no dataset, judge or program in these episodes)."""
    import socket

    def refuse(self, address):
        raise AssertionError(f"a network connection to {address} was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture
def taskset_id(tmp_path, monkeypatch):
    name = f"vf_sum_{tmp_path.name.replace('-', '_').lower()}"
    (tmp_path / f"{name}.py").write_text(TASKSET)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def environment(taskset: str, **params):
    return load_environment(TaskSpec(environment=EnvironmentSpec(name="verifiers",
                                                                  params={"taskset": taskset, **params})))


def call(a: int, b: int) -> str:
    return f'<tool_call>{{"name": "adder_add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'


def play(env, tok, replies: list[str], limits: Limits = Limits(max_turns=4)):
    """One episode as the actor plays it: the prompt rendered by the chat template, every reply the engine's ids
    ending in <|im_end|>, the tools' turns appended by MessageEncoder."""
    prompt = env.prompt(random.Random(0))
    prompt_ids = tok(render_prompt(prompt, tok), add_special_tokens=False)["input_ids"]
    turns = iter(replies)
    sampled: list[list[int]] = []

    def reply(ids: list[int]) -> Reply:
        out = list(tok(next(turns), add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
        sampled.append(out)
        return Reply(token_ids=out, logprobs=[-0.25] * len(out), version=2, finished=True, prompt_ids=list(ids))

    async def sample(ids: list[int], max_tokens: int) -> Reply:
        return reply(ids)

    encoder = MessageEncoder(tok, chat_template=True)
    episode = env.start(prompt)
    result = asyncio.run(run_episode(episode, reply(prompt_ids), sample, encoder,
                                     lambda ids: tok.decode(ids, skip_special_tokens=True), limits, 64))
    return prompt, episode, result, sampled, encoder


def test_a_tool_using_episode_is_scored_by_the_taskset_and_kept_as_exact_ids(taskset_id):
    from support.hf_models import bpe_tokenizer

    tok = bpe_tokenizer()  # Qwen's chat template
    env = environment(taskset_id, count=2)  # a param of the taskset's own config
    prompt, episode, result, sampled, encoder = play(env, tok, [call(0, 4), "4"])
    # The prompt: the task's system prompt with the toolset's tools listed, then its question.
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert "adder_add(a: int, b: int)" in prompt.messages[0]["content"] and prompt.text == "What is 0 + 4?"
    # verifiers' trace holds the exchange as its interception would record it, and verifiers scored it.
    trace = episode.trace
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "tool", "assistant"]
    (tool_call,) = trace.messages[2].tool_calls
    assert (tool_call.name, json.loads(tool_call.arguments)) == ("adder_add", {"a": 0, "b": 4})
    assert trace.tool_messages[0].content == "4" and trace.last_reply == "4"
    assert result.reward == 1.0 and trace.rewards["correct"].score == 1.0 and trace.metrics["tool_uses"] == 1.0
    assert (result.turns, result.tool_calls, result.tool_errors, result.truncated) == (2, 1, 0, False)
    # Exact ids: the sampled replies and the tool turn's ids, in order; the tool's span alone out of the loss.
    (begin, end), = result.env_spans
    assert result.tokens == sampled[0] + result.tokens[begin:end] + sampled[1] and begin == len(sampled[0])
    # (tests/support/hf_models.py's Qwen template renders a tool turn under its role)
    assert tok.decode(result.tokens[begin:end]) == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"
    group = protocol.RolloutGroup("g", result.prompt_ids, [protocol.Sample(
        completion_tokens=result.tokens, logprobs=result.logprobs, reward=result.reward, env_spans=result.env_spans,
        versions=result.versions, episode={"turns": result.turns})], 2, 1)
    (doc,) = group_to_documents(group, DocumentConfig(drop_singletons=False))
    mask, at = doc.loss_mask(), len(result.prompt_ids)
    assert doc.tokens.tolist() == result.prompt_ids + result.tokens
    assert mask[at:at + begin].all() and not mask[at + begin:at + end].any() and mask[at + end:].all()
    assert not encoder.drifted(prompt, result)  # the whole conversation renders to the same ids

    # The next task of the taskset (its own order), answered wrong without a tool: scored 0, one turn.
    prompt, episode, result, _, _ = play(env, tok, ["7"])
    assert prompt.text == "What is 1 + 4?" and result.reward == 0.0 and result.turns == 1
    assert episode.trace.metrics["tool_uses"] == 0.0
    # count=2: the third prompt is the first task again.
    assert env.prompt(random.Random(0)).text == "What is 0 + 4?"


def test_stop_hooks_bad_calls_and_a_raising_tool(taskset_id):
    from support.hf_models import bpe_tokenizer

    tok = bpe_tokenizer()
    env = environment(taskset_id)
    # The taskset's @vf.stop ends the episode after the reply that gives up.
    _, episode, result, _, _ = play(env, tok, ["I give up", "never sampled"])
    assert episode.trace.stop_condition == "gave_up" and result.turns == 1 and result.reward == 0.0
    # The taskset's next task (1 + 4): a call the model gets wrong is answered with the error (as an MCP server answers), and the episode goes on.
    _, episode, result, _, _ = play(env, tok, ['<tool_call>{"name": "adder_mul"}</tool_call>', "<tool_call>{x"
                                               "</tool_call>", call(1, 4), "5"])
    errors = [m.content for m in episode.trace.tool_messages]
    assert errors[0].startswith("Error: unknown tool 'adder_mul'") and errors[1].startswith("Error: not a tool call")
    assert errors[2] == "5" and result.reward == 1.0 and result.tool_calls == 3 and result.tool_errors == 0
    # A tool that raises ends the episode as a tool error (rlkube.core.actor.episodes), scored by the taskset.
    _, episode, result, _, _ = play(env, tok, [call(-1, 4)])
    assert result.tool_errors == 1 and result.turns == 1 and result.reward == 0.0


def test_errors_name_the_field(taskset_id, monkeypatch):
    with pytest.raises(TaskError) as err:
        environment("no_such_taskset_anywhere")
    assert err.value.field == "spec.task.environment.params.taskset" and "not found" in str(err.value)
    with pytest.raises(TaskError) as err:
        load_environment(TaskSpec(environment=EnvironmentSpec(name="verifiers")))
    assert err.value.field == "spec.task.environment.params.taskset" and "required" in str(err.value)
    with pytest.raises(TaskError) as err:
        environment(taskset_id, count="many")  # the taskset's own pydantic config refuses it
    assert err.value.field == "spec.task.environment.params" and "count" in str(err.value)
    with pytest.raises(TaskError) as err:
        environment(taskset_id, count=0)
    assert err.value.field == "spec.task.environment.params.taskset" and "yields no tasks" in str(err.value)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(TaskError) as err:
        environment(taskset_id)
    assert err.value.field == "spec.task.environment.name" and "rlkube[agents]" in str(err.value)
