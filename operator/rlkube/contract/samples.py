"""Rollout samples kept for people to read (`spec.samples`, docs/design.md §5.7): the rows of `samples.jsonl`,
how a completion is cut into turns, the append-only size-bounded file, and the Redis records that carry what a
training document lacks from the preprocessor to the trainer.

Here, in the contract, because four parties agree on it: the preprocessor writes the per-document records, actor 0
the evaluation's rows, the trainer the file, and `rlkube samples` / `rlkube report` read it (on the base install:
nothing here imports the training stack).

A row (one JSON object per line):
    kind           "train" (a step's sample) or "evaluation" (an evaluated version's)
    step           train: the step that trained on it; evaluation: the evaluated version (weights after that step)
    version        evaluation: the evaluated version; train: the trainer's version before the step
    weight_version the oldest weights that sampled its tokens; lag = version - weight_version (train)
    prompt         the prompt's text; completion: the whole completion's text
    turns          [{"role": "model" | "environment", "text", "tokens", "masked"}]: the completion in order; the
                   environment's answers are `masked` (out of the loss, as the prompt is)
    reward, advantage (train), finish_reason ("stop", "length", "truncated", "timeout"), episode (counts: turns,
    tool_calls, tool_errors, ...; multi-turn only), group, truncated (text cut at maxTextChars), time
    run            the run that kept it: the TrainingJob's uid in a cluster, the id `rlkube local` draws per run
                   (the job config's `uid`). A claim can outlive its job: a new job writing to it appends beside
                   an earlier job's rows, and neither its keeper nor its readers take those for its own.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE = "samples.jsonl"
TRAIN, EVALUATION = "train", "evaluation"
EVALUATION_FIELD = "rows"  # the field of an evaluation-samples stream entry: JSON {"version", "rows"}

FINISH_REASONS = ("stop", "length", "truncated", "timeout")


def finish_reason(finished: bool, episode: dict[str, Any] | None = None) -> str:
    """Why a completion ended: a stop token ("stop"), maxNewTokens ("length"), an episode's limit of turns or tokens
    ("truncated") or of time ("timeout")."""
    if episode:
        if episode.get("timed_out"):
            return "timeout"
        if episode.get("truncated"):
            return "truncated"
    return "stop" if finished else "length"


def turns(completion: Sequence[int], env_spans: Sequence[Sequence[int]] | None,
          decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """The completion cut at the environment's spans: the model's replies and the environment's answers in order,
    each decoded on its own."""
    out: list[dict[str, Any]] = []
    at = 0
    ids = list(completion)

    def add(role: str, begin: int, end: int) -> None:
        if end > begin:
            out.append({"role": role, "text": decode(ids[begin:end]), "tokens": end - begin,
                        "masked": role == "environment"})

    for begin, end in sorted((int(b), int(e)) for b, e in env_spans or ()):
        add("model", at, begin)
        add("environment", begin, end)
        at = max(at, end)
    add("model", at, len(ids))
    return out


def clip(row: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """The row with every text cut to `max_chars` (and `truncated` set when one was)."""
    cut = False

    def short(text: str) -> str:
        nonlocal cut
        if len(text) <= max_chars:
            return text
        cut = True
        return text[:max_chars]

    row = dict(row)
    for key in ("prompt", "completion"):
        if isinstance(row.get(key), str):
            row[key] = short(row[key])
    if isinstance(row.get("turns"), list):
        row["turns"] = [{**t, "text": short(str(t.get("text", "")))} for t in row["turns"]]
    if cut:
        row["truncated"] = True
    return row


@dataclass
class BoundedLog:
    """An append-only JSONL file of at most `max_bytes`: a row that would pass the bound is dropped (counted in
    `dropped`), never a row already written. Each row is one write() of one line, flushed and fsynced, so a reader
    (or a trainer restarted after a kill) sees whole rows only, but for a last line cut by a crash, which readers
    skip."""

    path: Path
    max_bytes: int
    dropped: int = 0

    def append(self, rows: Sequence[dict[str, Any]]) -> int:
        """Append rows while they fit; the number written."""
        return len(self.append_rows(rows))

    def append_rows(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append rows while they fit; the rows written (what else gets a copy takes only those)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = self.path.stat().st_size if self.path.exists() else 0
        written: list[dict[str, Any]] = []
        with open(self.path, "ab") as fh:
            for row in rows:
                line = (json.dumps(row, ensure_ascii=False, default=str) + "\n").encode()
                if size + len(line) > self.max_bytes:
                    self.dropped += 1
                    continue
                fh.write(line)
                size += len(line)
                written.append(row)
            fh.flush()
            os.fsync(fh.fileno())
        return written


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a samples file; a line that is not a JSON object (the last one cut by a crash) is skipped."""
    with open(path, "rb") as fh:
        yield from parse_rows(fh)


def parse_text(text: str) -> Iterator[dict[str, Any]]:
    """The rows of a samples file's text (read through the API server): cut at "\\n" alone, as the file is written;
    str.splitlines would also cut inside a row at the U+2028 or U+0085 a model's text may hold (JSON keeps them)."""
    return parse_rows(text.split("\n"))


def parse_rows(lines: Any) -> Iterator[dict[str, Any]]:
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield row


def of_run(rows: Iterable[dict[str, Any]], run: str | None) -> list[dict[str, Any]]:
    """The rows run `run` kept (every row when the reader does not know the run: a file copied on its own)."""
    return [r for r in rows if run is None or r.get("run") == run]


def evaluated_versions(path: Path, run: str | None = None) -> set[int]:
    """The versions whose evaluation rows run `run` wrote to the file (its restarted trainer does not write them
    twice; another run's rows are not its)."""
    return _numbers(path, EVALUATION, "version", run)


def kept_steps(path: Path, run: str | None = None) -> set[int]:
    """The steps whose training rows run `run` kept in the file: its trainer restarted from an older checkpoint
    trains those steps again and keeps none of them twice (the first rows stay: the file is only appended to). Rows
    of another run (an earlier job on the same claim) do not count: a new job keeps its own steps."""
    return _numbers(path, TRAIN, "step", run)


def _numbers(path: Path, kind: str, key: str, run: str | None) -> set[int]:
    if not path.exists():
        return set()
    return {int(r[key]) for r in read_rows(path)
            if r.get("kind") == kind and r.get("run") == run and isinstance(r.get(key), int)}


def record(group_id: str, index: int, finished: bool, episode: dict[str, Any] | None, actor: str) -> bytes:
    """The preprocessor's record of one training document, what the document itself does not carry (Fast-LLM's
    document format has no room for it): stored in the hash `StreamKeys.sample_records` under the document's stream
    id, read (and deleted) by the trainer."""
    return json.dumps({"group": group_id, "sample": index, "finish_reason": finish_reason(finished, episode),
                       "episode": episode, "actor": actor}).encode()


def now() -> float:
    return round(time.time(), 3)
