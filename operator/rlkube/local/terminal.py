"""The terminal UI of `rlkube local`: the progress bar and its status line while a job runs, and the one-line
summary at the end. Apart from the supervisor (rlkube.local.runner), which only hands it what it has followed.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rlkube.contract import counters
from rlkube.lifecycle.phases import Phase


def progress_bar(console: Console) -> Progress:
    """The job's bar: its name, the steps done of spec.algorithm.maxSteps, the status line, the time taken."""
    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ]
    return Progress(*columns, console=console, transient=False)


def status_line(metrics: list[dict[str, Any]], evaluations: list[dict[str, Any]], agent: dict[str, int | float],
                stalled: bool, actors_started: bool) -> str:
    """What the bar shows beside the step: the last step's reward, lag and speed, the last evaluation, the
    reward errors and agent counters so far, and STALLED."""
    if not metrics:
        return "waiting for inference" if not actors_started else "waiting for the first step"
    m = metrics[-1]
    parts = [f"reward {m.get('reward_mean', math.nan):.3f}"]
    if "lag_max" in m:
        parts.append(f"lag {m['lag_max']}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
    if evaluations:
        parts.append(f"eval {evaluations[-1]['reward_mean']:.3f} @v{evaluations[-1]['version']}")
    errors = sum(int(x.get("reward_errors") or 0) for x in metrics)
    if errors:
        parts.append(f"{errors} reward errors")  # samples whose reward function failed (scored 0)
    if agent:
        parts.append(agent_line(agent))
    if stalled:
        parts.append("STALLED")
    return "  ".join(parts)


def agent_line(agent: dict[str, int | float]) -> str:
    """The agent counters in the progress line: the status subset (status.agent), zeros left out."""
    parts = [f"{agent.get('episodes', 0)} episodes"]
    parts += [f"{agent[n]} {n.replace('_', ' ')}" for n in counters.AGENT_STATUS[1:-1] if agent.get(n)]
    if agent.get("turn_reward_mean") is not None:
        parts.append(f"turn reward {agent['turn_reward_mean']:.3f}")
    return ", ".join(parts)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary_line(result: Any) -> str:
    """The run's ending in one line (rich markup), from a rlkube.local.runner.RunResult: the phase and reason, the
    steps, the first and last rewards, the evaluation, the agent counters, the teardown, the time and the output."""
    s = result.summary()
    color = "green" if result.phase == Phase.SUCCEEDED else "red"
    return (
        f"[{color}]{result.phase}[/{color}] ({result.reason}: {result.message}); steps {s['steps']}/{s['max_steps']}; "
        f"reward first-10 {_fmt(s['reward_first'])}, last-10 {_fmt(s['reward_last'])}; "
        + (f"eval reward {_fmt(s['eval_reward_first'])} (v{s['eval_versions'][0]}) -> {_fmt(s['eval_reward_last'])} "
           f"(v{s['eval_versions'][-1]}); " if s["eval_versions"] else "") +
        (f"agent: {agent_line(result.agent)}; " if result.agent else "") +
        f"teardown {' -> '.join(s['teardown'])}; "
        f"{s['wall_seconds']}s; output {s['output_dir']}"
    )
