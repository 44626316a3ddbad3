"""The job's tracker run, kept in the trainer's checkpoint volume so a restarted trainer resumes it.

A run is one per job: its name is the job's, and the ids the trackers gave it (MLflow's run id, the W&B id drawn at
the first start) are written to `tracking/run.json` beside the checkpoints, so a trainer that restarts from them
logs to the same run. The file also holds, per tracker and series of metrics (the key's first path part: `train`,
`eval`), the newest step the tracker took (marked after its client returned): after a restart the steps up to it
are not logged again (a crash after the last checkpoint re-trains those steps; the trackers keep their first
values), so a run's steps never repeat, and steps still queued when the process died are logged by the next one.
The file names the run it belongs to (the TrainingJob's uid, or the id `rlkube local` drew): a new job on a reused
volume starts a run of its own instead of writing into the earlier job's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("rlkube.tracking")

RUN_FILE = "run.json"


def series(key: str) -> str:
    """The series a metric belongs to: its first path part (`train/loss` -> `train`), or the key itself."""
    return key.split("/", 1)[0]


class RunState:
    """The run's ids and, per tracker and series, the newest step it took; written atomically after each change."""

    def __init__(self, directory: Path | None, name: str, uid: str | None = None):
        self.path = None if directory is None else Path(directory) / RUN_FILE
        self.lock = threading.Lock()
        data: dict[str, Any] = {}
        if self.path is not None and self.path.is_file():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError) as exc:
                log.warning("tracking: ignoring unreadable %s (%s): starting a new run", self.path, exc)
                data = {}
        if uid and data.get("uid") != uid:
            if data:
                log.info("tracking: %s belongs to run %s, not to this job's (%s): starting a new run", self.path,
                         data.get("uid") or "(unnamed)", uid)
            data = {}
        self.uid = uid
        self.resumed = bool(data)
        self.name = str(data.get("name") or name)
        self.ids: dict[str, str] = {k: str(v) for k, v in (data.get("ids") or {}).items()}
        self.logged: dict[str, dict[str, int]] = {
            tracker: {k: int(v) for k, v in steps.items()} for tracker, steps in (data.get("logged") or {}).items()}
        if "wandb" not in self.ids:
            # W&B lets the client choose the id: drawn once per job, kept here (a name would collide across runs).
            self.ids["wandb"] = f"{_slug(name)[:40]}-{secrets.token_hex(4)}"
            self.save()

    def run_id(self, tracker: str) -> str | None:
        with self.lock:
            return self.ids.get(tracker)

    def set_run_id(self, tracker: str, run_id: str) -> None:
        with self.lock:
            self.ids[tracker] = run_id
        self.save()

    def unlogged(self, tracker: str, metrics: dict[str, float], step: int) -> dict[str, float]:
        """The metrics whose series this tracker has not logged at `step` or later in this run."""
        with self.lock:
            logged = self.logged.get(tracker, {})
            return {k: v for k, v in metrics.items() if step > logged.get(series(k), -1)}

    def mark(self, tracker: str, metrics: dict[str, float], step: int) -> None:
        """Record that the tracker has these metrics' series up to `step` (after it took them)."""
        if not metrics:
            return
        with self.lock:
            logged = self.logged.setdefault(tracker, {})
            for key in metrics:
                logged[series(key)] = max(step, logged.get(series(key), -1))
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        with self.lock:
            data = {"name": self.name, "uid": self.uid, "ids": dict(self.ids),
                    "logged": {t: dict(s) for t, s in self.logged.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{RUN_FILE}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)  # atomic; not fsynced: a run state lost with the machine costs duplicates
        except OSError as exc:  # a full or read-only volume must not fail training
            log.warning("tracking: could not write %s: %s", self.path, exc)


def _slug(name: str) -> str:
    """W&B run ids may not contain `/ \\ # ? % :`; Kubernetes names are already safe, local names may not be."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "job"
