"""MLflow (spec.tracking.mlflow): the job's run in an experiment of a tracking server, through `MlflowClient`.

The run is created once and its id kept in the run state (rlkube.core.tracking.run); a restarted trainer sets the
same run RUNNING again and logs on. Params are immutable in MLflow: a resumed run gets only the params it lacks.
Tables go through `MlflowClient.log_table`, one JSON artifact per table name, each row carrying its step (MLflow
appends to an existing table artifact). Imported only when the job configures MLflow (`mlflow-skinny`, the `core`
extra).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlkube.api.tracking import MlflowTrackingSpec
from rlkube.core.tracking.run import RunState

HTTP_TIMEOUT_S = "10"
HTTP_RETRIES = "2"
"""MLflow's defaults (120 s per request, 7 retries with backoff) would keep an unreachable server's failure minutes
away; it is found in seconds with these (the trainer never waits for it either way: rlkube.core.tracking.worker)."""
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


class MlflowSink:
    name = "mlflow"

    def __init__(self, spec: MlflowTrackingSpec, run: RunState, tags: dict[str, str]):
        self.spec = spec
        self.run = run
        self.tags = tags
        self.client: Any = None
        self.run_id: str | None = None

    def open(self) -> None:
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_RETRIES)
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        known = self.run.run_id(self.name)
        if known is not None:
            self.client.update_run(known, status="RUNNING")
            self.run_id = known
            return
        experiment = self.client.get_experiment_by_name(self.spec.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(self.spec.experiment_name))
        created = self.client.create_run(experiment_id, run_name=self.run.name, tags=self.tags)
        self.run_id = created.info.run_id
        self.run.set_run_id(self.name, self.run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        new = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items() if k not in have]
        for i in range(0, len(new), 100):  # MLflow's batch limit on params
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        columns = sorted({k for row in rows for k in row} | {"step"})
        data = {c: [_cell(row.get(c) if c != "step" else row.get(c, step)) for row in rows] for c in columns}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{name}.json")

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "KILLED")


def _cell(value: Any) -> Any:
    """A table cell MLflow's JSON table can hold: scalars as they are, anything else as its JSON text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    import json

    return json.dumps(value, default=str)
