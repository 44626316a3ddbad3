"""`verifiers` tasksets (prime-rl's environment library, PyPI verifiers 0.4.0) as rlkube environments: the taskset
runs unchanged, our engine plays the agent, and every turn stays the exact ids it sampled.

In verifiers 0.4.0 (`verifiers.v1`) an environment is a Taskset (its tasks: prompt, system prompt, `@vf.stop`
hooks, `@vf.reward`/`@vf.metric` scoring, judges, Toolsets of `@vf.tool` methods) played by a harness, an agent
program verifiers starts as a subprocess (a `uv` script) that talks to the model through an HTTP interception
server. That harness is what rlkube replaces: it installs its program with `uv` (a download, which a pod must not
do) and it re-renders the conversation on every call, which is the token drift rlkube exists to avoid
(rlkube.core.actor.episodes). Everything that is the environment's runs as verifiers runs it:
- tasks come from verifiers' own loader (`load_taskset`, a taskset id: an installed package exporting its Taskset
  subclass, as `vf-eval` takes it), with its config type and the config-layer system prompt;
- each reply is committed to a real `vf.Trace` through verifiers' message graph (`prepare_turn(...).commit`),
  as its interception server records a model call;
- the task's `@vf.stop` hooks (Trace and Response predicates, verifiers' own boundary rules) end the episode;
- tool calls go to the task's and taskset's Toolsets (`Task.toolsets`, `Taskset.toolsets`, their `setup` and
  `setup_task` hooks), called in process instead of behind an MCP server, by their advertised names
  (`<server>_<tool>`); the null harness's chat loop otherwise: a reply without a tool call ends the episode;
- the reward is `Task.score(trace)` (rewards, metrics and judges that need no sandbox runtime) and `trace.reward`.

Tool calls are written as Hermes/Qwen chat templates write them, `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; the tools are listed in the system prompt. A call the model gets wrong (not JSON, an unknown tool,
bad arguments) is answered with the error, as an MCP server answers it; a tool that raises ends the episode as a
tool error (rlkube.core.actor.episodes). Verifiers' coroutines run on an event loop of each episode's own, on the
episode's thread (rlkube.core.actor.episodes.call_with_timeout), never on the actor's loop.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rlkube.core.actor.task_types import Message, Prompt, TaskError

FIELD = "spec.task.environment.params"
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _vf() -> Any:
    try:
        import verifiers.v1 as vf  # imported here: the `agents` extra
    except ImportError as exc:
        raise TaskError("spec.task.environment.name", f"the verifiers environment needs the verifiers package, "
                        f"which is not installed ({exc}): install rlkube[agents] in the actor's image") from None
    return vf


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content if isinstance(content, str) else content_text(content)


class _Tools:
    """The Toolsets' `@vf.tool` methods by the names verifiers advertises them under."""

    def __init__(self, toolsets: list[Any]):
        from verifiers.v1.utils.decorators import discover_decorated

        self.toolsets = toolsets
        self.by_name: dict[str, Any] = {}
        for toolset in toolsets:
            for fn in discover_decorated(toolset, "tool"):
                name = getattr(fn, "tool_name", None) or fn.__name__
                prefix = toolset.server_name
                self.by_name[f"{prefix}_{name}" if prefix else name] = fn

    def describe(self) -> str:
        lines = [f"- {name}{inspect.signature(fn)}: {(fn.__doc__ or '').strip()}" for name, fn in self.by_name.items()]
        return ("Tools: call one with <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>\n"
                + "\n".join(lines))


class VerifiersEpisode:
    """One task played to its end: the rlkube Episode protocol over a vf.Trace."""

    def __init__(self, env: VerifiersEnvironment, task: Any, messages: list[Any]):
        from verifiers.v1.trace import AgentInfo, TraceTask

        vf = env.vf
        self.env, self.task, self.vf = env, task, vf
        self.loop = asyncio.new_event_loop()  # verifiers' coroutines, on this episode's thread
        self.trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                             hash=task.hash), agent=AgentInfo(config=vf.AgentConfig()))
        self.messages = messages  # the vf messages so far: the next reply's prompt
        own = type(task).toolsets(task.config)
        self._run(env.setup_shared())
        for toolset in own:
            self._run(toolset.setup())
        for toolset in [*own, *env.shared_toolsets]:
            self._run(toolset.setup_task(task))
        self.tools = _Tools([*own, *env.shared_toolsets])
        from verifiers.v1.session import hook_boundary

        stops = [(hook_boundary(fn, allow_trace=True), fn) for fn in task.hooks("stop")]
        self.stops = stops

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro) if inspect.isawaitable(coro) else coro

    def respond(self, reply: str) -> list[Message] | None:
        vf = self.vf
        calls = [self._parse(i, body) for i, body in enumerate(TOOL_CALL.findall(reply))]
        message = vf.AssistantMessage(content=reply, tool_calls=[c for c, _ in calls] or None)
        response = vf.Response(id=uuid.uuid4().hex, created=int(time.time()), model="rlkube", message=message,
                               finish_reason="tool_calls" if calls else "stop")
        from verifiers.v1.graph import prepare_turn

        prepare_turn(self.trace, self.messages).commit(response)
        self.messages = [*self.messages, message]
        if self._stopped(response) or not calls:
            return None
        answers = []
        for call, error in calls:
            content = error if error is not None else self._call(call)
            self.messages.append(vf.ToolMessage(tool_call_id=call.id, content=content, name=call.name))
            answers.append({"role": "tool", "content": content})
        return answers

    def _parse(self, index: int, body: str) -> tuple[Any, str | None]:
        """A ToolCall as the model wrote it, and the error to answer with when it cannot be called."""
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed.get("arguments", {})
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError) as exc:
            call = self.vf.ToolCall(id=f"call_{index}", name="invalid", arguments=body)
            return call, f"Error: not a tool call ({type(exc).__name__}: {exc})"
        call = self.vf.ToolCall(id=f"call_{index}", name=name, arguments=json.dumps(arguments))
        if name not in self.tools.by_name:
            return call, f"Error: unknown tool {name!r} (tools: {', '.join(self.tools.by_name) or 'none'})"
        try:
            inspect.signature(self.tools.by_name[name]).bind(**arguments)
        except TypeError as exc:
            return call, f"Error: {name}: {exc}"
        return call, None

    def _call(self, call: Any) -> str:
        result = self._run(self.tools.by_name[call.name](**json.loads(call.arguments)))
        return result if isinstance(result, str) else json.dumps(result, default=str)

    def _stopped(self, response: Any) -> bool:
        from verifiers.v1.session import call_hook

        for boundary, fn in self.stops:
            target = self.trace if boundary is self.vf.Trace else response if boundary is self.vf.Response else None
            if target is None:
                continue  # a Request stop guards the next request: there is none once this one is checked
            if self._run(call_hook(fn, {boundary: target})) is True:
                self.trace.stop(fn.__name__)
                return True
        return False

    def reward(self) -> float:
        try:
            self._run(self.task.score(self.trace))
            return float(self.trace.reward)
        finally:
            self.loop.close()


class VerifiersEnvironment:
    """A verifiers taskset's tasks as rlkube prompts, each started as a VerifiersEpisode."""

    raw_prompts = False  # chat messages: rendered with the model's chat template

    def __init__(self, taskset: Any, vf: Any):
        self.vf = vf
        self.taskset = taskset
        self.name = f"verifiers/{taskset.config.id}"
        self.shared_toolsets = type(taskset).toolsets(taskset.config)  # one per actor, as verifiers shares them
        self._shared_ready = False
        self.needs_chat_template = f"{FIELD}.taskset"
        if next(iter(taskset), None) is None:  # cycling through an empty taskset would never yield
            raise TaskError(f"{FIELD}.taskset", f"verifiers taskset {taskset.config.id!r} yields no tasks")
        self._tasks: Iterator[Any] = itertools.chain.from_iterable(itertools.repeat(taskset))
        self._last: dict[str, Any] = {}

    async def setup_shared(self) -> None:
        if not self._shared_ready:
            self._shared_ready = True
            for toolset in self.shared_toolsets:
                await toolset.setup()

    def _vf_messages(self, task: Any) -> list[Any]:
        vf, data = self.vf, task.data
        system = data.system_prompt or ""
        tools = _Tools([*type(task).toolsets(task.config), *self.shared_toolsets])
        if tools.by_name:
            system = f"{system}\n\n{tools.describe()}" if system else tools.describe()
        head = [vf.SystemMessage(content=system)] if system else []
        if data.prompt is None:
            raise TaskError(f"{FIELD}.taskset", f"task {data.idx} of {self.name} has no prompt (a user-opened task "
                            "needs verifiers' user-sim env, which rlkube does not drive)")
        if isinstance(data.prompt, str):
            return [*head, vf.UserMessage(content=data.prompt)]
        return [*head, *data.prompt]

    def prompt(self, rng: Any = None) -> Prompt:
        """The taskset's next task (in its own order, again from the start when it ends)."""
        task = next(self._tasks)
        vf_messages = self._vf_messages(task)
        messages = [{"role": m.role, "content": _text(m.content or "")} for m in vf_messages]
        return Prompt(task.data.prompt_text, {"task": task, "vf_messages": vf_messages}, messages)

    def start(self, prompt: Prompt) -> VerifiersEpisode:
        return VerifiersEpisode(self, prompt.meta["task"], list(prompt.meta["vf_messages"]))

    def __repr__(self) -> str:
        return f"VerifiersEnvironment({self.name!r})"


def factory(taskset: str = "", **config: Any) -> VerifiersEnvironment:
    """`spec.task.environment: {name: verifiers, params: {taskset: ID, ...}}`: the taskset verifiers' loader finds
    under ID (an installed package exporting its Taskset subclass), built with the other params as its config."""
    vf = _vf()
    if not taskset:
        raise TaskError(f"{FIELD}.taskset", "required: the id of a verifiers taskset (an installed package that "
                        "exports its Taskset subclass in __all__)")
    try:
        config_cls = vf.taskset_config_type(taskset)
    except (ImportError, TypeError, AttributeError, ValueError) as exc:
        raise TaskError(f"{FIELD}.taskset", f"verifiers cannot load taskset {taskset!r}: {exc}") from None
    try:
        built = vf.load_taskset(config_cls(id=taskset, **config))
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - the taskset's own code and its pydantic config
        raise TaskError(FIELD, f"verifiers taskset {taskset!r} with {config}: {type(exc).__name__}: {exc}") from None
    return VerifiersEnvironment(built, vf)
