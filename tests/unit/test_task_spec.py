"""spec.task's cross-field rules (dataset, reward, chat template), checked where the CRD schema cannot, naming the
field, and the CRD schema of the new fields."""

import pytest

from rlkube.lifecycle.validation import SpecError
from rlkube.api.crd import crd
from rlkube.lifecycle.validation import parse_spec

BASE = {"model": {"path": "builtin://tiny-llama"}, "algorithm": {"maxSteps": 3}, "inference": {"engine": "native"}}
DATASET = {"path": "/data/math.jsonl"}


def spec_with(task):
    return {**BASE, "task": task}


def errors_of(task) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_with(task))
    return {e.field: e.message for e in err.value.errors}


def test_a_dataset_task_with_each_reward_parses():
    for reward in ({"type": "math"}, {"type": "exact", "normalize": "whitespace", "ignoreCase": True},
                   {"type": "regex", "pattern": r"^\d+$"}, {"type": "python", "function": "my.rewards:score",
                                                            "params": {"weight": 2}}):
        spec = parse_spec(spec_with({"name": "gsm", "dataset": DATASET, "reward": reward}))
        assert spec.task.dataset.path == "/data/math.jsonl" and spec.task.reward.type == reward["type"]
    ds = parse_spec(spec_with({"dataset": {**DATASET, "messagesField": "chat"}, "reward": {"type": "math"}})).task.dataset
    assert ds.prompt_column is None and ds.messages_field == "chat"
    assert ds.format == "auto" and ds.shuffle and ds.shuffle_seed == 0 and ds.answer_field is None
    assert parse_spec(spec_with({"dataset": DATASET, "reward": {"type": "math"}})).task.dataset.prompt_column == "prompt"
    # a reward may also replace a built-in task's own reward
    assert parse_spec(spec_with({"name": "repeat-digit", "reward": {"type": "exact"}})).task.reward.type == "exact"


@pytest.mark.parametrize("task, field", [
    ({"dataset": DATASET}, "spec.task.reward"),
    ({"dataset": DATASET, "reward": {"type": "math"}, "entryPoint": "my.tasks:make"}, "spec.task.entryPoint"),
    ({"dataset": DATASET, "reward": {"type": "math"}, "params": {"x": 1}}, "spec.task.params"),
    ({"dataset": {**DATASET, "promptField": "q", "messagesField": "m"}, "reward": {"type": "math"}},
     "spec.task.dataset.messagesField"),
    ({"dataset": {"path": "/elsewhere/x.jsonl", "claimName": "data-pvc"}, "reward": {"type": "math"}},
     "spec.task.dataset.path"),
    ({"reward": {"type": "python"}}, "spec.task.reward.function"),
    ({"reward": {"type": "math", "function": "a:b"}}, "spec.task.reward.function"),
    ({"reward": {"type": "exact", "params": {"x": 1}}}, "spec.task.reward.params"),
    ({"reward": {"type": "regex"}}, "spec.task.reward.pattern"),
    ({"reward": {"type": "regex", "pattern": "(unclosed"}}, "spec.task.reward.pattern"),
    ({"reward": {"type": "exact", "pattern": "x"}}, "spec.task.reward.pattern"),
    ({"reward": {"type": "math", "answerPattern": "no group"}}, "spec.task.reward.answerPattern"),
    ({"reward": {"type": "math", "answerPattern": "(bad"}}, "spec.task.reward.answerPattern"),
    ({"reward": {"type": "regex", "pattern": "x", "answerPattern": "(x)"}}, "spec.task.reward.answerPattern"),
    ({"reward": {"type": "python", "function": "not a function"}}, "spec.task.reward.function"),
    ({"reward": {"type": "bleu"}}, "spec.task.reward.type"),
    ({"dataset": {**DATASET, "format": "csv"}, "reward": {"type": "math"}}, "spec.task.dataset.format"),
    ({"dataset": {"path": ""}, "reward": {"type": "math"}}, "spec.task.dataset.path"),
])
def test_bad_task_specs_name_the_field(task, field):
    errs = errors_of(task)
    assert field in errs, errs


def test_a_pvc_dataset_below_its_mount_path_parses():
    ds = parse_spec(spec_with({"dataset": {"path": "/datasets/gsm8k/train.parquet", "claimName": "gsm8k",
                                           "mountPath": "/datasets"}, "reward": {"type": "math"}})).task.dataset
    assert ds.claim_name == "gsm8k" and ds.mount_path == "/datasets"


def test_crd_schema_of_the_task_fields():
    task = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["task"]
    props = task["properties"]
    assert props["dataset"]["required"] == ["path"]
    assert props["dataset"]["properties"]["format"]["enum"] == ["auto", "jsonl", "parquet", "datasets"]
    assert props["reward"]["required"] == ["type"]
    assert props["reward"]["properties"]["type"]["enum"] == ["math", "exact", "regex", "python"]
    assert props["reward"]["properties"]["function"]["pattern"] == props["entryPoint"]["pattern"]
    assert props["chatTemplate"]["type"] == "boolean" and "default" not in props["chatTemplate"]
