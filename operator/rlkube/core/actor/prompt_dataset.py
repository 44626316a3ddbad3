"""Dataset tasks (`spec.task.dataset`): prompts read from JSONL, Parquet or a `datasets` directory, in the pods.

Loading goes through Hugging Face `datasets` (`load_dataset("json" | "parquet", data_files=...)`, `load_from_disk`),
so globs, split expressions (`train[:1000]`), nested JSON and Arrow types behave as users know them. Files are
read into memory through a throw-away cache directory (a pod's home may be read-only, and nothing should pile up
across restarts); a saved `datasets` directory is memory-mapped where it lies (a read-only PVC is fine).

Everything the spec names is checked when the actor starts, before it asks inference for anything: the path, the
format, the split, each mapped column, empty or null prompts. A failure raises `TaskError` naming the spec field
(`spec.task.dataset.promptField: no column 'question' in /data/math.jsonl (columns: problem, solution)`).

Rows are drawn in epochs: each epoch is a permutation of the rows seeded by (shuffleSeed, epoch), or file order
without `shuffle`, and actor replica i of R takes positions i, i+R, i+2R, ... of that sequence, so replicas never
draw the same row in the same epoch. A restarted actor starts again from the beginning of its sequence.
"""

from __future__ import annotations

import glob
import logging
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from rlkube.api.task import DatasetSpec
from rlkube.core.actor.task_types import Message, Prompt, TaskError

log = logging.getLogger("rlkube.tasks")

FIELD = "spec.task.dataset"
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
_BUILDERS = {"jsonl": "json", "parquet": "parquet"}


def resolve_format(spec: DatasetSpec) -> str:
    """`spec.format`, or for `auto`: a directory is a `datasets` directory, a file goes by its extension
    (compressed `.jsonl.gz` too)."""
    if spec.format != "auto":
        return spec.format
    path = Path(spec.path)
    if path.is_dir():
        return "datasets"
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in (".gz", ".bz2", ".xz", ".zst", ".zstd"):
        suffixes.pop()
    if suffixes and suffixes[-1] in _SUFFIXES:
        return _SUFFIXES[suffixes[-1]]
    raise TaskError(f"{FIELD}.format", f"cannot tell the format of {spec.path!r} from its name: set jsonl, parquet "
                    "or datasets")


def _missing(spec: DatasetSpec) -> TaskError:
    where = (f" (PersistentVolumeClaim {spec.claim_name!r} is mounted at {spec.mount_path})"
             if spec.claim_name else "")
    return TaskError(f"{FIELD}.path", f"{spec.path} does not exist{where}")


def load_rows(spec: DatasetSpec) -> Any:
    """The `datasets.Dataset` the spec names (one split). Raises TaskError."""
    import datasets  # imported here: only dataset tasks pay for it

    datasets.disable_progress_bars()
    has_glob = any(c in spec.path for c in "*?[")
    if (has_glob and not glob.glob(spec.path)) or (not has_glob and not Path(spec.path).exists()):
        raise _missing(spec)
    fmt = resolve_format(spec)
    if fmt == "datasets":
        return _load_saved(spec, datasets)
    if Path(spec.path).is_dir():
        raise TaskError(f"{FIELD}.format", f"{spec.path} is a directory, not a {fmt} file (use format datasets for "
                        f"a directory written by save_to_disk, or a glob such as dir/*.{fmt})")
    if not has_glob and Path(spec.path).stat().st_size == 0:
        raise TaskError(f"{FIELD}.path", f"{spec.path} is empty")
    split = spec.split or "train"
    cache = tempfile.mkdtemp(prefix="rlkube-dataset-")
    try:
        return datasets.load_dataset(_BUILDERS[fmt], data_files=spec.path, split=split, cache_dir=cache,
                                     keep_in_memory=True)
    except ValueError as exc:
        if any(word in str(exc).lower() for word in ("split", "instruction")):  # unknown split, or an empty slice
            raise TaskError(f"{FIELD}.split", f"{split!r} of {spec.path}: {exc} (a file is the split `train`)") from None
        raise TaskError(f"{FIELD}.path", f"cannot read {spec.path} as {fmt}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a malformed file fails in many ways inside the Arrow readers
        cause = exc.__cause__ or exc
        raise TaskError(f"{FIELD}.path", f"cannot read {spec.path} as {fmt}: {type(cause).__name__}: {cause}") from None
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _load_saved(spec: DatasetSpec, datasets: Any) -> Any:
    try:
        loaded = datasets.load_from_disk(spec.path)
    except FileNotFoundError as exc:
        raise TaskError(f"{FIELD}.path", f"{spec.path} is not a directory written by datasets' save_to_disk: "
                        f"{exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = spec.split or "train"
        if split not in loaded:
            raise TaskError(f"{FIELD}.split", f"{spec.path} has the splits {', '.join(loaded)}, not {split!r}")
        return loaded[split]
    if spec.split is not None:
        raise TaskError(f"{FIELD}.split", f"{spec.path} holds a single Dataset without splits; leave split unset")
    return loaded


def _is_text(feature: Any) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def check_columns(rows: Any, spec: DatasetSpec) -> None:
    """Every mapped column exists, prompts are text (or message lists) and never null. Raises TaskError."""
    if len(rows) == 0:
        raise TaskError(f"{FIELD}.path", f"{spec.path} holds no rows" + (f" in split {spec.split!r}" if spec.split
                                                                         else ""))
    columns = list(rows.column_names)
    mapped = [("promptField", spec.prompt_column), ("messagesField", spec.messages_field),
              ("completionField", spec.completion_field),  # the reference completion of loss sft
              ("answerField", spec.answer_field)]  # an unset answerField is optional (answer_column)
    for name, column in mapped:
        if column is not None and column not in columns:
            default = " (the default; set promptField or messagesField)" if (
                name == "promptField" and not spec.prompt_field) else ""
            raise TaskError(f"{FIELD}.{name}", f"no column {column!r} in {spec.path}{default} "
                            f"(columns: {', '.join(columns)})")
    for name, column in mapped[:3]:
        if column is None:
            continue
        nulls = rows.data.column(column).null_count
        if nulls:
            raise TaskError(f"{FIELD}.{name}", f"column {column!r} of {spec.path} is empty (null) in {nulls} of "
                            f"{len(rows)} rows")
    if spec.prompt_column is not None and not _is_text(rows.features[spec.prompt_column]):
        raise TaskError(f"{FIELD}.promptField", f"column {spec.prompt_column!r} of {spec.path} holds "
                        f"{rows.features[spec.prompt_column]}, not text")
    if spec.completion_field is not None and not _is_text(rows.features[spec.completion_field]):
        raise TaskError(f"{FIELD}.completionField", f"column {spec.completion_field!r} of {spec.path} holds "
                        f"{rows.features[spec.completion_field]}, not text")
    if spec.messages_field is not None:
        messages(rows[0][spec.messages_field], spec, 0)  # the first row's shape; the others when drawn


def messages(value: Any, spec: DatasetSpec, row: int) -> list[Message]:
    """A row's chat messages as [{role, content}, ...]; TaskError naming messagesField when they are not."""
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    if not ok:
        raise TaskError(f"{FIELD}.messagesField", f"row {row} of {spec.path}: column {spec.messages_field!r} must "
                        f"hold a non-empty list of {{role, content}} messages, got {str(value)[:200]}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


class DatasetTask:
    """Prompts from a dataset; no reward of its own (spec.task.reward supplies it)."""

    raw_prompts = False

    def __init__(self, name: str, rows: Any, spec: DatasetSpec, shard: tuple[int, int] = (0, 1)):
        index, replicas = shard
        if not 0 <= index < replicas:
            raise ValueError(f"shard {index} of {replicas}")
        self.name = name
        self.rows = rows
        self.spec = spec
        self.index, self.replicas = index, replicas
        self.turn = 0  # prompts drawn by this replica so far
        self._epoch: int | None = None
        self._order: np.ndarray | None = None
        self.answer_column = spec.answer_field or ("answer" if "answer" in rows.column_names else None)
        self.needs_chat_template = (f"{FIELD}.messagesField" if spec.messages_field
                                    else f"{FIELD}.systemPrompt" if spec.system_prompt else None)

    @classmethod
    def load(cls, name: str, spec: DatasetSpec, shard: tuple[int, int] = (0, 1)) -> DatasetTask:
        rows = load_rows(spec)
        check_columns(rows, spec)
        log.info("dataset %s: %d rows, columns %s (actor replica %d of %d)", spec.path, len(rows),
                 ", ".join(rows.column_names), shard[0], shard[1])
        return cls(name, rows, spec, shard)

    def __len__(self) -> int:
        return len(self.rows)

    def next_row(self) -> int:
        """The row this replica draws next."""
        position = self.turn * self.replicas + self.index
        self.turn += 1
        n = len(self.rows)
        epoch, offset = divmod(position, n)
        if not self.spec.shuffle:
            return offset
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.spec.shuffle_seed, epoch]).permutation(n)
            self._epoch = epoch
        return int(self._order[offset])  # type: ignore[index]

    def prompt(self, rng: random.Random | None = None) -> Prompt:
        """The next row as a Prompt (`rng` is unused: the order is the dataset's, fixed by shuffle/shuffleSeed)."""
        i = self.next_row()
        row = self.rows[i]
        spec = self.spec
        answer = row[self.answer_column] if self.answer_column else None
        meta = {"answer": answer, "sample": row, "row": i}
        if spec.completion_field:
            meta["completion"] = row[spec.completion_field]  # what loss sft trains on (rlkube.core.actor)
        system = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
        if spec.messages_field:
            chat = messages(row[spec.messages_field], spec, i)
            if system and chat[0]["role"] != "system":
                chat = system + chat
            text = next((m["content"] for m in reversed(chat) if m["role"] == "user"), chat[-1]["content"])
            return Prompt(text, meta, chat)
        text = row[spec.prompt_column]
        return Prompt(text, meta, system + [{"role": "user", "content": text}] if system else None)

    def __repr__(self) -> str:
        return f"DatasetTask({self.spec.path!r}, {len(self.rows)} rows)"
