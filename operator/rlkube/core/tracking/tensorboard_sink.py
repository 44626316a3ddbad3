"""TensorBoard (spec.tracking.tensorboard): event files in the trainer's checkpoint volume, written with tensorboardX
(a writer of TensorBoard's format without TensorFlow or tensorboard's server: the `core` extra stays small).

Every scalar is one `add_scalar(key, value, step)`; params go in once as a text summary (TensorBoard has no params
view); TensorBoard has no tables, so `log_table` is skipped. A restarted trainer opens a new event file in the same
directory, and TensorBoard reads them as one run (the steps already logged are not logged again: run.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLUSH_SECONDS = 10


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.writer: Any = None

    def open(self) -> None:
        from tensorboardX import SummaryWriter

        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(logdir=str(self.directory), flush_secs=FLUSH_SECONDS)

    def log_params(self, params: dict[str, Any]) -> None:
        text = "\n".join(f"    {k} = {json.dumps(v, default=str)}" for k, v in sorted(params.items()))
        self.writer.add_text("params", text, 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """TensorBoard has no tables."""

    def close(self, finished: bool) -> None:
        self.writer.close()
