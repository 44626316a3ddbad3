"""Weights & Biases (spec.tracking.wandb): the job's run, online or offline, through the `wandb` client.

The run id is drawn once per job and kept in the run state (rlkube.core.tracking.run); `resume="allow"` continues
it after a restart. Metrics are logged with their step as the metric `step` (the x-axis of every chart,
`define_metric`), not as W&B's own step counter, which W&B requires to only grow: an evaluation result arrives
after later training steps were logged. The API key comes from the environment (WANDB_API_KEY, set by the
operator from spec.tracking.wandb.apiKeySecret); offline runs are written under `tracking/wandb` in the checkpoint
volume (`wandb sync` uploads them later).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkube.api.tracking import WandbTrackingSpec
from rlkube.core.tracking.run import RunState

STEP = "step"
INIT_TIMEOUT_S = 30.0


class WandbSink:
    name = "wandb"

    def __init__(self, spec: WandbTrackingSpec, run: RunState, directory: Path, tags: dict[str, str]):
        self.spec = spec
        self.run_state = run
        self.directory = Path(directory)
        self.tags = tags
        self.run: Any = None

    def open(self) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(mode=self.spec.mode, init_timeout=INIT_TIMEOUT_S, silent=True, console="off",
                                  x_disable_stats=True, x_disable_meta=True,
                                  **({"base_url": self.spec.base_url} if self.spec.base_url else {}))
        self.run = wandb.init(project=self.spec.project, entity=self.spec.entity, name=self.run_state.name,
                              id=self.run_state.run_id(self.name), resume="allow", dir=str(self.directory),
                              tags=[f"{k}={v}" for k, v in self.tags.items()][:20], settings=settings)
        self.run.define_metric(STEP, hidden=True)
        self.run.define_metric("*", step_metric=STEP)

    def log_params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, STEP: step})

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        columns = sorted({k for row in rows for k in row})
        table = wandb.Table(columns=columns, data=[[_cell(row.get(c)) for c in columns] for row in rows])
        self.run.log({name: table, STEP: step})

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    import json

    return json.dumps(value, default=str)
