"""The real kube-apiserver accepts the example and rejects malformed TrainingJobs with 422 naming the field."""

import json

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import specs


def _create(api_client, namespace, body):
    return client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        "rlkube.io", "v1alpha1", namespace, "trainingjobs", body
    )


def test_example_is_accepted_and_defaulted(api_client, crd, namespace):
    created = _create(api_client, namespace, specs.document())
    spec = created["spec"]
    # Defaults come from the schema, nested objects included.
    assert spec["algorithm"]["clipEpsilonHigh"] == 0.2
    assert spec["runPolicy"]["restartPolicy"]["actor"] == "OnFailure"
    assert spec["task"]["params"] == {}
    assert spec["trainer"]["checkpoint"]["path"] == "/checkpoints"


def test_a_dataset_task_is_accepted_and_defaulted(api_client, crd, namespace):
    doc = specs.document()
    doc["metadata"]["name"] = "dataset-task"
    doc["spec"]["task"] = {"name": "gsm8k", "dataset": {"path": "/data/gsm8k.parquet", "claimName": "gsm8k"},
                           "reward": {"type": "math", "answerPattern": "#### (.*)"}}
    task = _create(api_client, namespace, doc)["spec"]["task"]
    assert task["dataset"] == {"path": "/data/gsm8k.parquet", "claimName": "gsm8k", "format": "auto",
                               "shuffle": True, "shuffleSeed": 0, "mountPath": "/data"}
    assert task["reward"] == {"type": "math", "answerPattern": "#### (.*)", "params": {}, "normalize": "strip",
                              "ignoreCase": False, "match": "full"}
    assert "chatTemplate" not in task  # unset: decided by the tokenizer


MALFORMED = [
    ("spec.algorithm.maxSteps", "ten", "spec.algorithm.maxSteps"),          # wrong type
    ("spec.algorithm.maxSteps", 0, "spec.algorithm.maxSteps"),              # zero maxSteps
    ("spec.actor.replicas", -1, "spec.actor.replicas"),                     # negative replicas
    ("spec.inference.replicas", 0, "spec.inference.replicas"),              # zero inference replicas
    ("spec.algorithm.loss", "dpo", "spec.algorithm.loss"),                  # unknown enum value
    ("spec.trainer.backend", "jax", "spec.trainer.backend"),                # unknown backend
    ("spec.model", specs.DELETE, "spec.model"),                             # missing model
    ("spec.model.path", "", "spec.model.path"),                             # empty model path
    ("spec.algorithm.learningRate", 0, "spec.algorithm.learningRate"),      # non-positive learning rate
    ("spec.redis.mode", "sentinel", "spec.redis.mode"),                     # unknown redis mode
    ("spec.runPolicy.backoffLimit", -2, "spec.runPolicy.backoffLimit"),     # negative backoff
    ("spec.redis.url", "http://x", "spec.redis.url"),                       # url pattern
    ("spec.trainer.nodes", 1.5, "spec.trainer.nodes"),                      # float for int
    ("spec.task.reward.type", "bleu", "spec.task.reward.type"),             # unknown reward
    ("spec.task.reward.function", "not a function", "spec.task.reward.function"),  # module:function pattern
    ("spec.task.dataset.format", "csv", "spec.task.dataset.format"),        # unknown dataset format
    ("spec.task.dataset.mountPath", "data", "spec.task.dataset.mountPath"),  # relative mount path
    # A Secret name the operator puts into a secretKeyRef: refused at apply, not when the pod is created.
    ("spec.tracking.wandb", {"project": "p", "apiKeySecret": {"name": "W_and_B", "key": "k"}},
     "spec.tracking.wandb.apiKeySecret.name"),
]


@pytest.mark.parametrize("path, value, field", MALFORMED, ids=[f"{m[0]}={m[1]!r}" for m in MALFORMED])
def test_malformed_is_rejected_with_field(api_client, crd, namespace, path, value, field):
    doc = specs.document(**{"metadata.name": "bad", path: value})
    with pytest.raises(ApiException) as err:
        _create(api_client, namespace, doc)
    assert err.value.status == 422
    body = json.loads(err.value.body)
    causes = [c.get("field", "") for c in body["details"]["causes"]]
    assert any(c == field or c.startswith(field + ".") or c.startswith(field + "[") for c in causes), causes
    assert field in body["message"]


def test_unknown_fields_are_pruned(api_client, crd, namespace):
    doc = specs.document()
    doc["metadata"]["name"] = "pruned"
    doc["spec"]["notAField"] = {"x": 1}
    doc["spec"]["algorithm"]["typoSteps"] = 3
    created = _create(api_client, namespace, doc)
    assert "notAField" not in created["spec"]
    assert "typoSteps" not in created["spec"]["algorithm"]
    assert created["spec"]["algorithm"]["maxSteps"] == 40
