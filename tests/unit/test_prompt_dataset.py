"""Dataset tasks on real files written here (JSONL, Parquet via pyarrow, a `datasets` save_to_disk directory):
field mapping, the draw order across epochs and actor replicas, chat messages, and every bad input failing at
load with a TaskError that names the spec field."""

import gzip
import json
import random
import re
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlkube.api.task import DatasetSpec, TaskSpec
from rlkube.core.actor.prompt_dataset import resolve_format
from rlkube.core.actor.tasks import JobTask, Scorer, TaskError, load_task

ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i), "id": i} for i in range(10)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def math_task(path, shard=(0, 1), **dataset) -> JobTask:
    spec = TaskSpec(name="sums", dataset={"path": str(path), "promptField": "question", **dataset},
                    reward={"type": "math"})
    return load_task(spec, shard=shard)


def draw(task, n):
    rng = random.Random(0)
    return [task.prompt(rng) for _ in range(n)]


def test_jsonl_prompts_answers_and_math_reward(tmp_path):
    task = math_task(write_jsonl(tmp_path / "sums.jsonl", ROWS))
    assert task.name == "sums" and len(task.source) == 10
    prompts = draw(task, 10)
    assert sorted(p.meta["row"] for p in prompts) == list(range(10))  # one epoch: every row once
    for p in prompts:
        i = p.meta["row"]
        assert p.text == f"What is {i} + {i}?" and p.messages is None
        assert p.meta["answer"] == str(2 * i) and p.meta["sample"] == ROWS[i]
        assert task.reward(p, f"so it is \\boxed{{{2 * i}}}") == 1.0
        assert task.reward(p, f"{2 * i + 1}") == 0.0


def test_parquet_gz_jsonl_and_globs_load_the_same_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "sums.parquet")
    with gzip.open(tmp_path / "sums.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[4:])
    for path in ("sums.parquet", "sums.jsonl.gz", "part-*.jsonl"):
        task = math_task(tmp_path / path, shuffle=False)
        assert [p.text for p in draw(task, 10)] == [r["question"] for r in ROWS], path
    assert resolve_format(DatasetSpec(path=str(tmp_path / "sums.parquet"))) == "parquet"
    assert resolve_format(DatasetSpec(path=str(tmp_path / "x.json"))) == "jsonl"
    assert resolve_format(DatasetSpec(path=str(tmp_path))) == "datasets"
    # an explicit format reads a file whatever its name
    (tmp_path / "sums.data").write_bytes((tmp_path / "sums.parquet").read_bytes())
    assert len(math_task(tmp_path / "sums.data", format="parquet").source) == 10


def test_saved_datasets_directories_with_and_without_splits(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:6]),
                          "test": datasets.Dataset.from_list(ROWS[6:])}).save_to_disk(str(tmp_path / "dict"))
    assert len(math_task(tmp_path / "single").source) == 10
    assert len(math_task(tmp_path / "dict").source) == 6  # split defaults to train
    test = math_task(tmp_path / "dict", split="test", shuffle=False)
    assert [p.meta["answer"] for p in draw(test, 4)] == ["12", "14", "16", "18"]
    with pytest.raises(TaskError, match=r"spec.task.dataset.split: .* has the splits train, test, not 'dev'"):
        math_task(tmp_path / "dict", split="dev")
    with pytest.raises(TaskError, match="spec.task.dataset.split: .* single Dataset without splits"):
        math_task(tmp_path / "single", split="train")


def test_a_split_expression_selects_rows_of_a_file(tmp_path):
    task = math_task(write_jsonl(tmp_path / "sums.jsonl", ROWS), split="train[:3]", shuffle=False)
    assert [p.meta["row"] for p in draw(task, 4)] == [0, 1, 2, 0]


def test_epochs_reshuffle_and_replicas_take_turns(tmp_path):
    path = write_jsonl(tmp_path / "sums.jsonl", ROWS)
    one = [p.meta["row"] for p in draw(math_task(path), 30)]
    epochs = [one[0:10], one[10:20], one[20:30]]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] and epochs[0] != list(range(10))  # a new order each epoch
    assert one == [p.meta["row"] for p in draw(math_task(path), 30)]  # fixed by the seed
    assert one != [p.meta["row"] for p in draw(math_task(path, shuffleSeed=1), 30)]
    # three actor replicas interleave over the same sequence: together they draw it exactly, none repeats another
    shards = [[p.meta["row"] for p in draw(math_task(path, shard=(i, 3)), 10)] for i in range(3)]
    merged = [shards[k % 3][k // 3] for k in range(30)]
    assert merged == one
    assert Counter(merged) == Counter({i: 3 for i in range(10)})
    assert [p.meta["row"] for p in draw(math_task(path, shuffle=False), 12)] == [*range(10), 0, 1]


def test_default_prompt_and_answer_columns(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "2+2=", "answer": 4}, {"prompt": "3+3=", "answer": 6}])
    task = load_task(TaskSpec(dataset={"path": str(path), "shuffle": False}, reward={"type": "exact"}))
    p = task.prompt(random.Random(0))
    assert (p.text, p.meta["answer"]) == ("2+2=", 4) and task.reward(p, " 4 ") == 1.0


def test_messages_column_and_system_prompt(tmp_path):
    rows = [{"chat": [{"role": "user", "content": "Say hi"}], "answer": "hi"},
            {"chat": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say yo"}],
             "answer": "yo"}]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    spec = TaskSpec(dataset={"path": str(path), "messagesField": "chat", "systemPrompt": "You are helpful.",
                             "shuffle": False}, reward={"type": "exact", "ignoreCase": True})
    task = load_task(spec)
    assert task.needs_chat_template == "spec.task.dataset.messagesField"
    first, second = draw(task, 2)
    assert first.messages == [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Say hi"}]
    assert first.text == "Say hi"
    assert second.messages[0] == {"role": "system", "content": "Be terse."}  # a row's own system message stays
    assert len(second.messages) == 2
    assert task.reward(first, "HI") == 1.0
    # a system prompt turns text prompts into chat messages too
    text = load_task(TaskSpec(dataset={"path": str(write_jsonl(tmp_path / "t.jsonl", ROWS)), "promptField": "question",
                                       "systemPrompt": "Think.", "shuffle": False}, reward={"type": "math"}))
    p = text.prompt(random.Random(0))
    assert p.messages == [{"role": "system", "content": "Think."}, {"role": "user", "content": ROWS[0]["question"]}]
    assert text.needs_chat_template == "spec.task.dataset.systemPrompt"


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory):
    """One directory of good and bad dataset files for every bad-input case."""
    tmp = tmp_path_factory.mktemp("bad")
    write_jsonl(tmp / "sums.jsonl", ROWS)
    write_jsonl(tmp / "nulls.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}])
    (tmp / "empty.jsonl").write_text("")
    (tmp / "broken.jsonl").write_text('{"prompt": "a", "answer": 1}\n{"prompt": \n')
    (tmp / "sums.csv").write_text("prompt,answer\n1+1,2\n")
    (tmp / "plain-dir").mkdir()
    no_rows = datasets.Dataset.from_dict({"prompt": ["a"], "answer": ["1"]}).filter(lambda row: False)
    no_rows.save_to_disk(str(tmp / "empty-saved"))
    return tmp


@pytest.mark.parametrize("dataset, field, message", [
    ({"path": "{tmp}/missing.jsonl"}, "spec.task.dataset.path", "does not exist"),
    ({"path": "{tmp}/nothing-*.jsonl"}, "spec.task.dataset.path", "does not exist"),
    ({"path": "{tmp}/sums.jsonl", "promptField": "problem"}, "spec.task.dataset.promptField",
     "no column 'problem' in .* \\(columns: question, answer, id\\)"),
    ({"path": "{tmp}/sums.jsonl"}, "spec.task.dataset.promptField", "no column 'prompt' .* \\(the default"),
    ({"path": "{tmp}/sums.jsonl", "promptField": "question", "answerField": "solution"},
     "spec.task.dataset.answerField", "no column 'solution'"),
    ({"path": "{tmp}/sums.jsonl", "messagesField": "chat"}, "spec.task.dataset.messagesField", "no column 'chat'"),
    ({"path": "{tmp}/sums.jsonl", "messagesField": "question"}, "spec.task.dataset.messagesField",
     "must hold a non-empty list of \\{role, content\\} messages"),
    ({"path": "{tmp}/sums.jsonl", "promptField": "id"}, "spec.task.dataset.promptField", "holds .*int64.*, not text"),
    ({"path": "{tmp}/nulls.jsonl"}, "spec.task.dataset.promptField", "is empty \\(null\\) in 1 of 2 rows"),
    ({"path": "{tmp}/empty.jsonl"}, "spec.task.dataset.path", "empty.jsonl is empty"),
    ({"path": "{tmp}/sums.jsonl", "promptField": "question", "split": "train[10:]"}, "spec.task.dataset.split",
     "corresponds to no data"),
    ({"path": "{tmp}/empty-saved"}, "spec.task.dataset.path", "holds no rows"),
    ({"path": "{tmp}/broken.jsonl"}, "spec.task.dataset.path", "cannot read .* as jsonl"),
    ({"path": "{tmp}/sums.csv"}, "spec.task.dataset.format", "cannot tell the format"),
    ({"path": "{tmp}/sums.jsonl", "format": "parquet"}, "spec.task.dataset.path", "cannot read .* as parquet"),
    ({"path": "{tmp}/sums.jsonl", "split": "test"}, "spec.task.dataset.split", "'test'"),
    ({"path": "{tmp}", "format": "jsonl"}, "spec.task.dataset.format", "is a directory"),
    ({"path": "{tmp}/plain-dir"}, "spec.task.dataset.path", "not a directory written by datasets"),
    ({"path": "/data/{tmp}/x.jsonl", "claimName": "data"}, "spec.task.dataset.path",
     "does not exist \\(PersistentVolumeClaim 'data' is mounted at /data\\)"),
])
def test_bad_datasets_name_the_field(bad_inputs, dataset, field, message):
    spec = TaskSpec(dataset={k: v.format(tmp=bad_inputs) if isinstance(v, str) else v for k, v in dataset.items()},
                    reward={"type": "math"})
    with pytest.raises(TaskError) as err:
        load_task(spec)
    assert err.value.field == field, str(err.value)
    assert str(err.value).startswith(field + ": ")
    assert re.search(message, str(err.value)), str(err.value)


def test_a_reward_that_needs_answers_needs_an_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}])
    with pytest.raises(TaskError, match="spec.task.dataset.answerField: the exact reward compares"):
        load_task(TaskSpec(dataset={"path": str(path)}, reward={"type": "exact"}))
    with pytest.raises(TaskError, match="spec.task.dataset.answerField"):
        load_task(TaskSpec(dataset={"path": str(path)}, reward={"type": "regex", "pattern": "(?P<answer>x)"}))
    fmt = load_task(TaskSpec(dataset={"path": str(path)}, reward={"type": "regex", "pattern": "^h"}))
    p = fmt.prompt(random.Random(0))
    assert p.meta["answer"] is None and fmt.reward(p, "hi") == 1.0


def test_a_row_whose_answer_math_verify_cannot_read_is_a_counted_error(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x", "answer": "!!!"}])
    task = load_task(TaskSpec(dataset={"path": str(path)}, reward={"type": "math"}))
    scorer = Scorer(task)
    assert scorer(task.prompt(random.Random(0)), "4") == (0.0, True) and scorer.errors == 1
