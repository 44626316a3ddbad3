"""Where a job's multi-turn environment comes from (spec.task.environment): a built-in by name (`calculator`, or
`verifiers`: a verifiers taskset driven by rlkube.core.actor.verifiers_env), or a user's importable
`package.module:factory` called with **params.

An environment that cannot be built (an unknown name, a module that does not import, a factory that raises or
returns something without `start`) raises TaskError naming the spec field: the actor exits with
runtime.EXIT_CONFIG at start and the job fails with that message (rlkube.core.errors), rather than restarting
an actor that can never run an episode.

A factory that declares a `sandbox` parameter gets the job's code-execution sandbox (rlkube.core.actor.sandbox, limits
from spec.task.environment.sandbox; with spec.sandbox.mode `pods` the job's sandbox pods instead,
rlkube.core.actor.sandbox_client): its tools call `sandbox.python_tool(code)` (the built-in `python` tool) or
`sandbox.run(code)`.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from rlkube.api.task import EnvironmentSpec, TaskSpec
from rlkube.contract import runtime
from rlkube.core.actor import calculator
from rlkube.core.actor.episodes import Environment, Limits, draws_own_prompts
from rlkube.core.actor.sandbox import Sandbox, SandboxLimits, network_namespace_available
from rlkube.core.actor.sandbox_client import RemoteSandbox
from rlkube.core.actor.task_types import TaskError, import_attribute

log = logging.getLogger("rlkube.environments")


def _verifiers(**params: Any) -> Environment:
    from rlkube.core.actor import verifiers_env  # imported here: verifiers is an optional extra (`agents`)

    return verifiers_env.factory(**params)


BUILTIN_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {"calculator": calculator.factory,
                                                               "verifiers": _verifiers}


def load_environment(spec: TaskSpec) -> Environment | None:
    """The job's environment; None for single-turn tasks. Raises TaskError."""
    env = spec.environment
    if env is None:
        return None
    if env.entry_point:
        field = "spec.task.environment.entryPoint"
        factory = import_attribute(env.entry_point, field)
    else:
        field = "spec.task.environment.name"
        factory = BUILTIN_ENVIRONMENTS.get(env.name or "")
        if factory is None:
            raise TaskError(field, f"unknown built-in environment {env.name!r} (known: {', '.join(BUILTIN_ENVIRONMENTS)})")
    if not callable(factory):
        raise TaskError(field, f"{env.entry_point!r} is not callable")
    kwargs: dict[str, Any] = dict(env.params)
    if _wants_sandbox(factory):
        if "sandbox" in kwargs:
            raise TaskError("spec.task.environment.params.sandbox", "the factory's `sandbox` parameter is the job's "
                            "sandbox (spec.task.environment.sandbox), not a param")
        kwargs["sandbox"] = sandbox(env)
    try:
        built: Any = factory(**kwargs)
    except TaskError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory: whatever it raises fails the job, named
        raise TaskError(field, f"the environment factory raised {type(exc).__name__}: {exc}") from None
    if not callable(getattr(built, "start", None)):
        raise TaskError(field, f"the factory returned {built!r}, which has no start(prompt) method")
    others = [f for f in spec.prompt_sources() if f != "spec.task.environment.name"]
    if others and draws_own_prompts(built):
        # One prompt source (docs/design.md §2.4): validation refuses a built-in environment with another; only
        # building an entryPoint's tells whether it draws its own, and then the other would be ignored.
        raise TaskError(field, f"{env.entry_point or env.name!r} draws its own prompts (it has prompt()) and "
                        f"{others[0]} is set too: set one prompt source")
    if not isinstance(getattr(built, "name", None), str):
        try:
            built.name = env.name or env.entry_point
        except AttributeError:
            pass
    return built


def _wants_sandbox(factory: Callable[..., Any]) -> bool:
    try:
        return "sandbox" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a callable without a signature (a builtin): it cannot ask
        return False


def sandbox(env: EnvironmentSpec, environ: Mapping[str, str] | None = None) -> Sandbox | RemoteSandbox:
    """The job's code-execution sandbox: the sandbox servers the launcher named (runtime.ENV_SANDBOX_URLS, set
    with spec.sandbox.mode `pods`), else the in-process one. Either says which layers hold the snippet."""
    s = env.sandbox
    lim = SandboxLimits(timeout_s=s.timeout_seconds, cpu_s=s.cpu_seconds, memory_mb=s.memory_mib,
                        output_bytes=s.output_bytes, processes=s.processes)
    urls = [u for u in (os.environ if environ is None else environ).get(runtime.ENV_SANDBOX_URLS, "").split(",") if u]
    if urls:
        log.info("code-execution sandbox: %d sandbox server(s) %s, %s; each snippet in its own sandbox pod's "
                 "runtime, a network namespace and the audit hook (docs/guide/sandbox.md)", len(urls), urls, lim)
        return RemoteSandbox(urls, lim)
    built = Sandbox(lim)
    log.info("code-execution sandbox: in process (the actor's user, filesystem and pod), %s; network refused by %s",
             built.limits, "a network namespace and the audit hook" if network_namespace_available() else
             "the audit hook alone (this kernel gives no unprivileged user namespace here)")
    return built


def limits(env: EnvironmentSpec, max_sequence_length: int | None) -> Limits:
    """The episode limits of the spec; the token budget defaults to maxSequenceLength (longer documents are
    dropped by the preprocessor, so an episode past it is wasted)."""
    budget = env.max_episode_tokens if env.max_episode_tokens is not None else max_sequence_length
    return Limits(max_turns=env.max_turns, max_episode_tokens=budget, tool_timeout_s=env.tool_timeout_seconds,
                  episode_timeout_s=env.episode_timeout_seconds, sum_turn_rewards=env.episode_reward == "sum")
