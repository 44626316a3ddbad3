"""api/validation.py's public functions, called directly: each rule the CRD schema cannot express gives the field
it names and nothing else, the example passes them all, and parse_spec / parse_manifest put the errors together.
(The same rules through the operator and `rlkube local`: test_controller_decisions.py, test_model_pods.py,
test_pod_templates.py, test_crd.py.)"""

from __future__ import annotations

from decimal import Decimal

import pytest
from support import specs

from rlkube.contract import parallel
from rlkube.lifecycle import validation
from rlkube.lifecycle.image_reference import reference_error
from rlkube.api.spec import GPU, TrainingJobSpec
from rlkube.lifecycle.environment import operator_env_names


def typed(**overrides) -> TrainingJobSpec:
    """The example's spec with `overrides`, through the schema only (no cross-field rule checked yet)."""
    return TrainingJobSpec.model_validate(specs.spec(**overrides))


def fields(errors: list[validation.FieldError]) -> list[str]:
    return [e.field for e in errors]


# -- the example, and the error types -------------------------------------------------------------------------


@pytest.mark.parametrize("check", [validation.resource_errors, validation.pod_field_errors, validation.model_errors,
                                   validation.rank_errors, validation.template_errors, validation.semantic_errors])
def test_the_example_passes_every_rule(check):
    assert check(typed()) == []


def test_the_example_passes_the_task_rules():
    assert validation.task_errors(typed().task) == []


def test_a_spec_error_names_every_field():
    errors = [validation.FieldError("spec.a", "bad"), validation.FieldError("spec.b", "worse")]
    err = validation.SpecError(errors)
    assert isinstance(err, ValueError) and err.errors == errors
    assert str(err) == "spec.a: bad; spec.b: worse"


# -- quantities and resources ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    (4, Decimal(4)), ("4", Decimal(4)), ("500m", Decimal("0.5")), ("2Gi", Decimal(2 * 2**30)), ("1k", Decimal(1000)),
    ("1e3", Decimal(1000)), (".5", Decimal("0.5")), ("+1M", Decimal(10**6)), ("-1", Decimal(-1)),
])
def test_parse_quantity_follows_the_api_servers_grammar(value, expected):
    assert validation.parse_quantity(value) == expected


@pytest.mark.parametrize("value", ["", "abc", "1.2.3", "5 Gi", "1Gb", "Gi"])
def test_parse_quantity_refuses_what_is_not_a_quantity(value):
    with pytest.raises(ValueError, match="is not a quantity"):
        validation.parse_quantity(value)


@pytest.mark.parametrize(("resources", "field", "says"), [
    ({"requests": {"gpu": "1"}}, "spec.trainer.resources.requests.gpu", "unknown resource 'gpu'"),
    ({"requests": {"cpu": "lots"}}, "spec.trainer.resources.requests.cpu", "is not a quantity"),
    ({"limits": {"memory": "-1Gi"}}, "spec.trainer.resources.limits.memory", "must not be negative"),
    ({"limits": {"example.com/fpga": "500m"}}, "spec.trainer.resources.limits.example.com/fpga", "whole units"),
    ({"requests": {"example.com/fpga": "1"}}, "spec.trainer.resources.requests.example.com/fpga",
     "a limit equal to its request"),
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}, "spec.trainer.resources.requests.cpu",
     "must not exceed the limit 1"),
    ({"requests": {"hugepages-2Mi": "1Gi"}, "limits": {"hugepages-2Mi": "1Gi"}}, "spec.trainer.resources",
     "hugepages need a cpu or memory"),
])
def test_resource_errors_name_the_resource(resources, field, says):
    errors = validation.resource_errors(typed(**{"trainer.resources": resources}))
    assert fields(errors) == [field] and says in errors[0].message, errors


def test_resource_errors_take_the_gpu_count_the_operator_derives():
    # A GPU request written in resources is replaced by gpusPerNode, so it is not compared with a stale limit.
    spec = typed(**{"trainer.gpusPerNode": 2, "trainer.resources": {"requests": {GPU: "1"}}})
    assert validation.resource_errors(spec) == []


# -- pod fields, model, GPUs, ranks ---------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "field"), [
    ({"image": " ghcr.io/rlkube/core:0.1.0"}, "spec.image"),
    ({"trainer.image": "x:1 "}, "spec.trainer.image"),
    ({"actor.image": "my image:latest"}, "spec.actor.image"),
    ({"redis.image": "Redis:7"}, "spec.redis.image"),
    ({"inference.image": "ghcr.io/rlkube/vllm:"}, "spec.inference.image"),
    ({"redis.mode": "external", "redis.url": "redis://r:6379/0", "redis.passwordSecret": {"name": "Bad_Name",
                                                                                           "key": "password"}},
     "spec.redis.passwordSecret.name"),
    ({"redis.mode": "external", "redis.url": "redis://r:6379/0", "redis.passwordSecret": {"name": "s", "key": ".."}},
     "spec.redis.passwordSecret.key"),
    ({"trainer.checkpoint.path": "checkpoints"}, "spec.trainer.checkpoint.path"),
    ({"trainer.checkpoint.path": "/tmp"}, "spec.trainer.checkpoint.path"),
    ({"model.path": "/models/m", "model.claimName": "m", "model.mountPath": "/"}, "spec.model.mountPath"),
])
def test_pod_field_errors_name_the_field(overrides, field):
    assert fields(validation.pod_field_errors(typed(**overrides))) == [field]


@pytest.mark.parametrize("image", [
    "redis", "redis:7-alpine", "ghcr.io/rlkube/core:0.1.0", "localhost:5000/rlkube/core", "my-registry.local:443/a/b_c",
    "docker.io/library/python:3.11-slim-bookworm", "[::1]:5000/x:tag", "Registry.Example.com/x", "a__b/c---d:T_1.x",
    "ghcr.io/x/y@sha256:" + "ab" * 32, "ghcr.io/x/y:1.0@sha256:" + "0f" * 32,
])
def test_image_references_the_kubelet_pulls_are_accepted(image):
    assert reference_error(image) is None


@pytest.mark.parametrize(("image", "says"), [
    ("my image:latest", "contains whitespace"), (" redis", "leading or trailing whitespace"),
    ("Redis:7", "must be lower case"), ("ghcr.io/RLKube/core", "must be lower case"), ("x:", "not an image"),
    ("x:-tag", "not an image"), ("-x", "not an image"), ("a..b", "not an image"), ("x/", "not an image"),
    ("x@sha256:abc", "not an image"), ("x:" + "t" * 129, "not an image"), ("ghcr.io//x", "not an image"),
    ("a/" + "b" * 260, "at most 255"),
])
def test_image_references_that_cannot_be_pulled_are_refused_saying_why(image, says):
    assert says in reference_error(image)


def test_pod_field_errors_ignore_the_secret_of_a_managed_redis():
    assert validation.pod_field_errors(typed(**{"redis.passwordSecret": {"name": "Bad_Name", "key": ".."}})) == []


@pytest.mark.parametrize(("overrides", "field"), [
    ({"model.path": "builtin://tiny-gpt"}, "spec.model.path"),
    ({"model.path": "s3://bucket/model"}, "spec.model.path"),
    ({"model.path": "hf://org/tiny", "model.claimName": "m"}, "spec.model.claimName"),
    ({"model.path": "/elsewhere/m", "model.claimName": "m", "model.mountPath": "/models"}, "spec.model.path"),
])
def test_model_errors_name_the_field(overrides, field):
    errors = validation.model_errors(typed(**overrides))
    assert fields(errors) == [field] and not errors[0].message.startswith("spec.model.path"), errors


def test_a_model_directory_below_its_claims_mount_is_fine():
    assert validation.model_errors(typed(**{"model.path": "/models/m", "model.claimName": "m",
                                            "model.mountPath": "/models"})) == []


@pytest.mark.parametrize(("overrides", "role", "gpus"), [
    ({}, "trainer", 0),
    ({"trainer.gpusPerNode": 2}, "trainer", 2),
    ({"trainer.gpusPerNode": 1, "inference.engine": "vllm", "inference.tensorParallel": 2}, "inference", 2),
    ({"inference.engine": "vllm", "inference.tensorParallel": 2}, "inference", 0),  # a CPU job's vLLM
    ({"trainer.gpusPerNode": 1}, "actor", 0),
])
def test_gpus_per_pod(overrides, role, gpus):
    assert typed(**overrides).gpus_per_pod(role) == gpus


@pytest.mark.parametrize(("overrides", "field"), [
    ({"trainer.processesPerNode": 2, "trainer.backend": "fast-llm"}, "spec.trainer.processesPerNode"),
    ({"trainer.processesPerNode": 1, "trainer.gpusPerNode": 2}, "spec.trainer.processesPerNode"),
    ({"trainer.megatron": {"tensorParallel": 2}}, "spec.trainer.megatron.tensorParallel"),  # backend torch
    ({"trainer.backend": "megatron", "trainer.nodes": 3, "trainer.megatron": {"tensorParallel": 2}},
     "spec.trainer.megatron.tensorParallel"),
    ({"trainer.cpuOffload": True}, "spec.trainer.cpuOffload"),
    ({"trainer.sharding": "fsdp", "trainer.backend": "megatron"}, "spec.trainer.sharding"),
    ({"trainer.sharding": "fsdp"}, "spec.trainer.sharding"),  # one rank
    ({"trainer.sharding": "fsdp", "trainer.nodes": 2}, "spec.trainer.checkpoint.claimName"),
])
def test_rank_errors_name_the_field(overrides, field):
    assert fields(validation.rank_errors(typed(**overrides))) == [field]


def test_fsdp_over_several_nodes_with_a_shared_claim_is_fine():
    assert validation.rank_errors(typed(**{"trainer.sharding": "fsdp", "trainer.nodes": 2,
                                           "trainer.checkpoint.claimName": "shared"})) == []


# -- pod templates --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "template", "field"), [
    ("actor", {"metadata": {"labels": {"app.kubernetes.io/managed-by": "me"}}},
     "spec.actor.template.metadata.labels[app.kubernetes.io/managed-by]"),
    ("actor", {"spec": {"containers": [{"name": "sidecar"}]}}, "spec.actor.template.spec.containers[sidecar]"),
    ("actor", {"spec": {"containers": [{"name": "actor", "env": [{"name": "X", "value": "1"},
                                                                  {"name": "X", "value": "2"}]}]}},
     "spec.actor.template.spec.containers[actor].env[X]"),
    ("actor", {"spec": {"containers": [{"name": "actor", "env": [{"name": "X"}]}]}},
     "spec.actor.template.spec.containers[actor].env[X]"),
    ("actor", {"spec": {"containers": [{"name": "actor", "volumeMounts": [{"name": "nowhere",
                                                                           "mountPath": "/data"}]}]}},
     "spec.actor.template.spec.containers[actor].volumeMounts[/data].name"),
    ("actor", {"spec": {"volumes": [{"name": "v", "emptyDir": {}}, {"name": "v", "emptyDir": {}}]}},
     "spec.actor.template.spec.volumes[v]"),
    ("actor", {"spec": {"volumes": [{"name": "v"}]}}, "spec.actor.template.spec.volumes[v]"),
])
def test_template_errors_name_the_field(role, template, field):
    assert fields(validation.template_errors(typed(**{f"{role}.template": template}))) == [field]


def test_template_errors_refuse_the_operators_env():
    name = sorted(operator_env_names(typed(), "trainer"))[0]
    template = {"spec": {"containers": [{"name": "trainer", "env": [{"name": name, "value": "x"}]}]}}
    errors = validation.template_errors(typed(**{"trainer.template": template}))
    assert fields(errors) == [f"spec.trainer.template.spec.containers[trainer].env[{name}]"]
    assert errors[0].message == "set by the operator"


def test_a_redis_template_needs_a_managed_redis():
    errors = validation.template_errors(typed(**{"redis.mode": "external", "redis.url": "redis://r:6379/0",
                                                 "redis.template": {"metadata": {"labels": {"team": "a"}}}}))
    assert fields(errors) == ["spec.redis.template"]


# -- the task -------------------------------------------------------------------------------------------------

DATASET = {"path": "/data/prompts.jsonl"}


@pytest.mark.parametrize(("task", "field"), [
    ({"name": "t", "dataset": DATASET}, "spec.task.reward"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "exact"}, "entryPoint": "m:f"}, "spec.task.entryPoint"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "exact"}, "params": {"a": 1}}, "spec.task.params"),
    ({"name": "t", "dataset": {**DATASET, "promptField": "p", "messagesField": "m"}, "reward": {"type": "exact"}},
     "spec.task.dataset.messagesField"),
    ({"name": "t", "dataset": {"path": "/other/p.jsonl", "claimName": "c"}, "reward": {"type": "exact"}},
     "spec.task.dataset.path"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "python"}}, "spec.task.reward.function"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "exact", "function": "m:f"}}, "spec.task.reward.function"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "exact", "params": {"a": 1}}}, "spec.task.reward.params"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "regex"}}, "spec.task.reward.pattern"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "exact", "pattern": "x"}}, "spec.task.reward.pattern"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "regex", "pattern": "("}}, "spec.task.reward.pattern"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "math", "answerPattern": "####"}},
     "spec.task.reward.answerPattern"),
    ({"name": "t", "dataset": DATASET, "reward": {"type": "math", "answerPattern": "(x"}},
     "spec.task.reward.answerPattern"),
])
def test_task_errors_name_the_field(task, field):
    assert fields(validation.task_errors(typed(task=task).task)) == [field]


def test_a_dataset_task_with_its_reward_is_fine():
    task = {"name": "t", "dataset": DATASET, "reward": {"type": "math", "answerPattern": "#### (.*)"}}
    assert validation.task_errors(typed(task=task).task) == []


# -- fast-llm, and the rules across sections ------------------------------------------------------------------


def test_fast_llm_errors_list_what_the_example_lacks_for_it():
    errors = validation.fast_llm_errors(typed(**{"trainer.backend": "fast-llm", "algorithm.loss": "ppo"}))
    # The native engine receives Fast-LLM's broadcast (core.fast_llm_weights), so engine: native is no error.
    assert fields(errors) == ["spec.trainer.gpusPerNode", "spec.trainer.fastLlm.modelFormat", "spec.model.path",
                              "spec.algorithm.loss"]


def test_fast_llm_errors_pass_a_job_made_for_it():
    spec = typed(**{"trainer.backend": "fast-llm", "trainer.gpusPerNode": 1, "trainer.fastLlm": {"modelFormat": "llama"},
                    "model.path": "/models/llama", "inference.engine": "vllm"})
    assert validation.fast_llm_errors(spec) == []


@pytest.mark.parametrize(("overrides", "field"), [
    ({"redis.mode": "external"}, "spec.redis.url"),
    ({"redis.url": "redis://r:6379/0"}, "spec.redis.url"),
    ({"algorithm.groupSize": 1}, "spec.algorithm.groupSize"),
    ({"trainer.nodes": 2, "algorithm.samplesPerStep": 1, "algorithm.groupSize": 2}, "spec.algorithm.samplesPerStep"),
    ({"algorithm.clipEpsilonLow": 1}, "spec.algorithm.clipEpsilonLow"),
    ({"inference.tensorParallel": 2}, "spec.inference.tensorParallel"),  # native engine
    ({"inference.engine": "vllm", "inference.tensorParallel": 4}, "spec.inference.tensorParallel"),  # 2 heads
    ({"algorithm.warmupSteps": 40, "algorithm.lrSchedule": "cosine"}, "spec.algorithm.warmupSteps"),
])
def test_semantic_errors_name_the_field(overrides, field):
    assert field in fields(validation.semantic_errors(typed(**overrides)))


def test_an_sft_job_takes_groups_of_one():
    assert "spec.algorithm.groupSize" not in fields(
        validation.semantic_errors(typed(**{"algorithm.loss": "sft", "algorithm.groupSize": 1})))


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "says"), [
    (8, 8, 2, None),
    (8, 2, 4, None),  # fewer key/value heads than workers: each is repeated evenly
    (6, 6, 4, "its 6 attention heads do not divide among 4"),
    (8, 3, 2, "its 3 key/value heads"),
    (8, 3, 4, "its 3 key/value heads"),
])
def test_tensor_parallel_heads_error(heads, kv_heads, tp, says):
    got = parallel.tensor_parallel_heads_error(heads, kv_heads, tp)
    assert got is None if says is None else says in got


# -- parse_spec and parse_manifest ----------------------------------------------------------------------------


def test_parse_spec_returns_the_typed_spec():
    spec = validation.parse_spec(specs.spec())
    assert isinstance(spec, TrainingJobSpec) and spec.algorithm.max_steps == 40


def test_parse_spec_names_schema_errors_under_its_prefix():
    with pytest.raises(validation.SpecError) as err:
        validation.parse_spec(specs.spec(**{"algorithm.maxSteps": "ten", "bogus": 1}), prefix="job")
    assert set(fields(err.value.errors)) == {"job.algorithm.maxSteps", "job.bogus"}


def test_parse_spec_reports_every_cross_field_error_at_once():
    with pytest.raises(validation.SpecError) as err:
        validation.parse_spec(specs.spec(**{"redis.mode": "external", "algorithm.groupSize": 1}))
    assert fields(err.value.errors) == ["spec.redis.url", "spec.algorithm.groupSize"]


def test_parse_manifest_returns_metadata_and_spec():
    meta, spec = validation.parse_manifest(specs.document())
    assert meta["name"] == "tiny-cpu" and spec == validation.parse_spec(specs.spec())


@pytest.mark.parametrize(("doc", "expected"), [
    ([], ["(document)"]),
    ({"spec": specs.spec()}, ["apiVersion", "kind", "metadata.name"]),
    (specs.document(kind="TrainingJobs"), ["kind"]),
    (specs.document(**{"metadata.name": ""}), ["metadata.name"]),
    (specs.document(**{"spec.algorithm.maxSteps": 0}), ["spec.algorithm.maxSteps"]),
])
def test_parse_manifest_names_what_is_wrong(doc, expected):
    with pytest.raises(validation.SpecError) as err:
        validation.parse_manifest(doc)
    assert fields(err.value.errors) == expected


@pytest.mark.parametrize("environment, overrides, field", [
    ({"name": "calculator"}, {}, None),
    ({"entryPoint": "pkg.envs:make", "maxEpisodeTokens": 32}, {"model.maxSequenceLength": 32}, None),
    ({}, {}, "spec.task.environment.name"),
    ({"name": "calculator", "entryPoint": "pkg.envs:make"}, {}, "spec.task.environment.name"),
    ({"name": "calculator", "maxEpisodeTokens": 64}, {"model.maxSequenceLength": 32},
     "spec.task.environment.maxEpisodeTokens"),
])
def test_environment_rules(environment, overrides, field):
    spec = typed(**{"task.environment": environment, **overrides})
    fields = [e.field for e in validation.environment_errors(spec)]
    assert fields == ([] if field is None else [field])
    assert [e.field for e in validation.semantic_errors(spec) if "environment" in e.field] == fields
