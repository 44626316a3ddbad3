"""The reward plot `rlkube local` writes beside metrics.jsonl (reward.png): matplotlib, imported only when there is
something to draw, so the supervisor (rlkube.local.runner) starts without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_rewards(metrics: list[dict[str, Any]], path: Path, title: str,
                 evaluations: list[dict[str, Any]] = ()) -> Path | None:
    """The steps' mean training reward and, with spec.evaluation, the eval set's mean reward at each evaluated
    weight version (version v is the weights after step v)."""
    points = [(m["step"], m["reward_mean"]) for m in metrics if "step" in m and "reward_mean" in m]
    evals = [(e["version"], e["reward_mean"]) for e in evaluations]
    if not points and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label="training samples (per step)")
    if evals:
        ax.plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label="held-out eval set (per version)")
        ax.legend(loc="best", fontsize="small")
    ax.set_xlabel("optimizer step / weight version")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
