"""The trainer's sample tables (`spec.samples`, docs/design.md §5.7): every `everySteps` steps, `perStep` of the step's
documents as readable rows appended to `samples.jsonl` in the trainer's output, and the evaluation's rows as actor 0
sends them; each table also goes to the job's trackers that keep tables.

Here, in the trainer, because it alone knows which documents a step trained on (and the weights' version), and it
alone has a durable volume (the checkpoint volume in a cluster). A document carries tokens, loss spans, advantage,
reward and per-token versions; what it cannot carry (Fast-LLM's format is fixed) the preprocessor left in the
records hash under the document's stream id: its group, finish reason and episode counts. The trainer deletes the
records of every document it reads, so the hash holds only documents in flight.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import redis

from rlkube.api.spec import SamplesSpec
from rlkube.contract import protocol
from rlkube.contract import samples as contract

log = logging.getLogger("rlkube.trainer")

TABLE_TRAIN, TABLE_EVALUATION = "samples", "evaluation_samples"  # the trackers' table names


class SampleKeeper:
    """What one trainer process does for `spec.samples`. `decode` turns token ids into text (the model's
    tokenizer, special tokens kept: what the model saw); `trackers` has `log_table(name, rows, step)` (rlkube.core.tracking) or is
    None. `run` identifies the run (the job config's uid): every row carries it, and only this run's rows already
    in the file count as kept (a claim reused by a new job holds an earlier job's rows)."""

    def __init__(self, spec: SamplesSpec, client: redis.Redis, keys: protocol.StreamKeys, out_dir: Path,
                 decode: Any, trackers: Any = None, leader: bool = True, run: str | None = None):
        self.spec = spec
        self.redis = client
        self.keys = keys
        self.path = Path(out_dir) / contract.FILE
        self.file = contract.BoundedLog(self.path, spec.max_bytes)
        self._decode = decode
        self.trackers = trackers
        self.leader = leader
        self.run = run
        self.enabled = spec.every_steps > 0
        self.eval_from = "0-0"
        self.eval_done: set[int] | None = None  # this run's versions in the file (read at the first drain)
        self.kept: set[int] | None = None  # this run's steps in the file (read at the first due step)

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode(list(ids))

    def due(self, step: int) -> bool:
        return self.enabled and self.leader and step % self.spec.every_steps == 0

    def forget(self, docs: Sequence[protocol.Document]) -> None:
        """Delete the records of documents read (every reading rank, every step)."""
        ids = [d.stream_id for d in docs if d.stream_id is not None]
        if self.enabled and ids:
            self.redis.hdel(self.keys.sample_records, *ids)

    def keep_step(self, step: int, version: int, docs: Sequence[protocol.Document]) -> list[dict[str, Any]]:
        """The rows of step `step` (trained by weights `version`), appended and logged when the step is due."""
        if not self.due(step) or not docs:
            return []
        if self.kept is None:
            self.kept = contract.kept_steps(self.path, self.run)
        if step in self.kept:  # trained again by a trainer restarted from an older checkpoint: kept once
            return []
        chosen = sorted(random.Random(step).sample(range(len(docs)), min(self.spec.per_step, len(docs))))
        picked = [docs[i] for i in chosen]
        raw = self.redis.hmget(self.keys.sample_records, [d.stream_id or "" for d in picked])
        rows = [contract.clip(self.row(step, version, d, _record(r)), self.spec.max_text_chars)
                for d, r in zip(picked, raw, strict=True)]
        self._write(TABLE_TRAIN, rows, step)
        self.kept.add(step)
        return rows

    def row(self, step: int, version: int, doc: protocol.Document, record: dict[str, Any]) -> dict[str, Any]:
        """One document as a row (rlkube.contract.samples)."""
        ids = [int(t) for t in doc.tokens]
        prompt_end = doc.loss_masking_spans[0][1] if doc.loss_masking_spans and doc.loss_masking_spans[0][0] == 0 \
            else 0
        env_spans = [(b - prompt_end, e - prompt_end) for b, e in doc.loss_masking_spans[1:]]
        completion = ids[prompt_end:]
        sampled = None
        if doc.model_version is not None:
            mask = doc.loss_mask()
            if mask.any():
                sampled = int(doc.model_version[mask].min())
        row = {
            "kind": contract.TRAIN,
            "step": step,
            "version": version,
            "weight_version": sampled,
            "lag": None if sampled is None else version - sampled,
            "prompt": self.decode(ids[:prompt_end]),
            "completion": self.decode(completion),
            "turns": contract.turns(completion, env_spans, self.decode),
            "reward": float(doc.reward),
            "advantage": float(doc.advantage),
            "finish_reason": record.get("finish_reason"),
            "group": record.get("group"),
            "tokens": {"prompt": prompt_end, "completion": len(completion)},
            "time": contract.now(),
            "run": self.run,
        }
        if record.get("episode"):
            row["episode"] = record["episode"]
        if doc.reward_error:
            row["reward_error"] = True
        return row

    def drain_evaluations(self, step: int) -> list[dict[str, Any]]:
        """Append the evaluation rows actor 0 sent since the last call (each evaluated version once in the file)."""
        if not self.enabled or not self.leader:
            return []
        if self.eval_done is None:
            self.eval_done = contract.evaluated_versions(self.path, self.run)
        got = self.redis.xread({self.keys.evaluation_samples: self.eval_from}, count=100)
        out: list[dict[str, Any]] = []
        for _, entries in got or []:
            for sid, fields in entries:
                self.eval_from = protocol.text(sid)
                try:
                    payload = orjson.loads(fields.get(contract.EVALUATION_FIELD.encode(),
                                                      fields.get(contract.EVALUATION_FIELD, b"")))
                    version, rows = int(payload["version"]), list(payload["rows"])
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    log.warning("skipping evaluation samples entry %s: %s", self.eval_from, exc)
                    continue
                if version in self.eval_done:
                    continue
                self.eval_done.add(version)
                rows = [contract.clip({**r, "run": self.run}, self.spec.max_text_chars) for r in rows
                        if isinstance(r, dict)]
                self._write(TABLE_EVALUATION, rows, version)
                out += rows
        return out

    def _write(self, table: str, rows: list[dict[str, Any]], step: int) -> None:
        """Append to the file and send the rows it took to the trackers: maxBytes bounds the trackers' tables too
        (MLflow rewrites a table artifact whole at each append)."""
        before = self.file.dropped
        rows = self.file.append_rows(rows)
        if self.file.dropped > before:
            log.warning("%s: %d sample rows not written (spec.samples.maxBytes %d reached; %d in all)", self.path,
                        self.file.dropped - before, self.spec.max_bytes, self.file.dropped)
        if self.trackers is not None and rows:
            try:
                self.trackers.log_table(table, rows, step)
            except Exception as exc:  # noqa: BLE001 - a tracker never fails training
                log.warning("logging the %s table of step %d to the trackers failed: %s", table, step, exc)


def _record(raw: Any) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def output_dir(output: Path | None, checkpoint_dir: Path | None) -> Path:
    """Where the trainer keeps samples.jsonl: the launcher's output directory (`rlkube local`: the run's), else the
    checkpoint directory (a cluster's durable volume)."""
    return Path(output or checkpoint_dir or "checkpoints")
