"""A fast-llm job's Fast-LLM config against the committed record of Fast-LLM's fields, and its trainer pod against
what Fast-LLM's launcher (torchrun + `fast-llm train gpt --config ...`) expects.

The record, tests/fixtures/fast_llm_config_fields.json, was written by tests/support/fast_llm_fields.py from Fast-LLM's
own config classes at one commit (Fast-LLM needs Python 3.12; these tests run on 3.11), and that tool also had
Fast-LLM's CLI validate the sample configs. Here: every field the operator writes is a recorded Fast-LLM field
with a value of its type; the sample configs are still the ones Fast-LLM validated; the values follow the spec;
the ConfigMap carries the config and no secret; the pod's torchrun arguments parse with torch's own parser.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.manifests import builders, fastllm, names
from rlkube.contract import protocol, runtime
from torch.distributed.run import config_from_args, get_args_parser
from support.specs import with_overrides

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "fast_llm_config_fields.json").read_text())
FIELDS = FIXTURE["fields"]
REGENERATE = ("re-record with tests/support/fast_llm_fields.py --validate (Python 3.12, Fast-LLM at "
              f"{FIXTURE['fast_llm']['commit'][:12]}); see its docstring")


def leaves(config: dict, path: str = "") -> dict[str, object]:
    """Dotted leaf paths, dict-of-dynamic-type keys written as `<type>` as in the record."""
    out: dict[str, object] = {}
    for key, value in config.items():
        where = f"{path}.{key}" if path else key
        if where in FIXTURE["dict_fields"]:
            for entry in value.values():
                out.update(leaves(entry, f"{where}.<{entry['type']}>"))
        elif isinstance(value, dict):
            out.update(leaves(value, where))
        else:
            out[where] = value
    return out


def type_error(field: dict, value: object) -> str | None:
    if value is None:
        return None if field["nullable"] or field["default"] is None else "null for a non-nullable field"
    kind = field["kind"]
    ok = {
        "bool": isinstance(value, bool),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "path": isinstance(value, str) and value.startswith("/"),
    }.get(kind)
    if kind in ("enum", "checkpoint_format", "dynamic_type"):
        ok = value in field["choices"]
    if ok is None:
        return f"unknown kind {kind}"
    return None if ok else f"{value!r} is not a {kind}" + (f" in {field['choices']}" if "choices" in field else "")


def sample_config(name: str) -> dict:
    sample = FIXTURE["samples"][name]
    return fastllm.training_config(parse_spec(sample["spec"]), sample["namespace"], sample["job"])


def spec(**changes) -> dict:
    """The fast-llm example's spec with `changes`, `__` for a dot: spec(trainer__nodes=2)."""
    return with_overrides(copy.deepcopy(FIXTURE["samples"]["examples/fast-llm.yaml"]["spec"]),
                          {path.replace("__", "."): value for path, value in changes.items()})


def job(raw: dict, name: str = "fl", namespace: str = "ns") -> builders.JobRef:
    return builders.JobRef(namespace=namespace, name=name, uid="uid-1", spec=parse_spec(raw), raw_spec=raw)


# --- the record itself ---------------------------------------------------------------------------------------


def test_record_is_for_the_fast_llm_commit_the_image_installs():
    assert FIXTURE["fast_llm"]["commit"] == fastllm.FAST_LLM_COMMIT
    dockerfile = (ROOT / "images" / "trainer-fast-llm" / "Dockerfile").read_text()
    (commit,) = re.findall(r"^ARG FAST_LLM_COMMIT=(\w+)$", dockerfile, re.M)
    assert commit == fastllm.FAST_LLM_COMMIT
    # Every field says where Fast-LLM declares it.
    for path, field in FIELDS.items():
        assert field["declared"]["file"].startswith("fast_llm/") and field["declared"]["line"] > 0, path


def test_shipped_example_is_the_sample_fast_llm_validated():
    example = yaml.safe_load((ROOT / "examples" / "fast-llm.yaml").read_text())
    sample = FIXTURE["samples"]["examples/fast-llm.yaml"]
    assert (sample["spec"], sample["job"]) == (example["spec"], example["metadata"]["name"]), REGENERATE


@pytest.mark.parametrize("name", sorted(FIXTURE["samples"]))
def test_samples_are_the_configs_fast_llm_validated(name):
    sample = FIXTURE["samples"][name]
    assert sample["fast_llm_validate"]["returncode"] == 0
    config = sample_config(name)
    # Keys the record lists as added after the validation run (recorded fields, checked field by field below).
    for key in sample.get("not_validated", {}).get("keys", []):
        *parents, leaf = key.split(".")
        node = config
        for part in parents:
            node = next(iter(node.values())) if part.startswith("<") else node[part]
        del node[leaf]
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    assert digest == sample["config_sha256"], f"the config of {name} changed since Fast-LLM validated it: {REGENERATE}"


# --- field for field -------------------------------------------------------------------------------------------

SPECS = {
    "example": spec(),
    "gspo-llama-2x8": spec(algorithm__loss="gspo", trainer__nodes=2, trainer__checkpoint={"claimName": "c"},
                           trainer__fastLlm={"modelFormat": "llama"}, inference__replicas=4),
    "mistral-fp32": spec(model__dtype="float32", trainer__fastLlm={"modelFormat": "mistral"}),
    "mixtral-fp16-1gpu": spec(model__dtype="float16", trainer__gpusPerNode=1, trainer__fastLlm={"modelFormat": "mixtral"}),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_field_written_is_a_recorded_fast_llm_field_of_its_type(name):
    config = fastllm.training_config(parse_spec(SPECS[name]), "ns", "fl")
    written = leaves(config)
    unknown = sorted(set(written) - set(FIELDS))
    assert not unknown, f"not in the Fast-LLM record: {unknown}; {REGENERATE}"
    errors = {p: e for p, v in written.items() if (e := type_error(FIELDS[p], v))}
    assert not errors, errors


def test_the_type_check_catches_what_it_is_for():
    # The check above is only worth something if it flags a wrong name, type, enum value or dynamic type.
    config = sample_config("examples/fast-llm.yaml")
    config["schedule"]["docs_per_stepp"] = 1
    assert "schedule.docs_per_stepp" not in FIELDS and "schedule.docs_per_stepp" in leaves(config)
    assert type_error(FIELDS["training.train_iters"], 1.5)
    assert type_error(FIELDS["training.train_iters"], True)
    assert type_error(FIELDS["data.shuffle"], "sometimes")
    assert type_error(FIELDS["pretrained.format"], "gpt2")
    assert type_error(FIELDS["callbacks.<streaming>.type"], "stream")
    assert type_error(FIELDS["optimizer.gradient_norm_clipping"], 2) is None  # YAML ints are floats too


def test_model_formats_and_losses_of_the_spec_exist_in_fast_llm():
    from typing import get_args

    from rlkube.api.spec import FastLLMModelFormat

    assert set(get_args(FastLLMModelFormat)) <= set(FIELDS["pretrained.format"]["choices"])
    assert set(fastllm.LOSS_TYPES.values()) <= set(FIXTURE["dict_fields"]["model.base_model.head.losses"]["types"])
    assert "streaming" in FIXTURE["dict_fields"]["data.datasets"]["types"]
    assert "streaming" in FIXTURE["dict_fields"]["callbacks"]["types"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_values_follow_the_spec(name):
    s = parse_spec(SPECS[name])
    c = fastllm.training_config(s, "ns", "fl")
    algo, fmt = s.algorithm, s.trainer.fast_llm.model_format
    assert c["pretrained"] == {"format": fmt, "path": s.model.path, "model_weights": True}
    assert c["training"]["train_iters"] == algo.max_steps
    assert c["schedule"]["docs_per_step"] == algo.samples_per_step
    loss = c["model"]["base_model"]["head"]["losses"][algo.loss]
    assert loss["type"] == algo.loss
    assert (loss["epsilon_low"], loss["epsilon_high"]) == (algo.clip_epsilon_low, algo.clip_epsilon_high)
    assert loss["logits_scale_factor"] == pytest.approx(1 / algo.temperature)
    assert c["model"]["distributed"] == {"compute_dtype": s.model.dtype, "seed": s.model.seed}
    assert c["optimizer"]["learning_rate"]["base"] == algo.learning_rate
    assert c["optimizer"]["gradient_norm_clipping"] == pytest.approx(algo.grad_clip_norm * algo.samples_per_step)
    assert c["data"]["micro_batch_size"] == s.model.max_sequence_length
    assert c["run"]["experiment_dir"] == s.trainer.checkpoint.path
    assert c["training"]["checkpoint"]["interval"] == s.trainer.checkpoint.interval_steps
    assert c["training"]["export"] == {"format": fmt, "interval": algo.max_steps}
    stream = c["callbacks"]["streaming"]
    assert stream["export"]["format"] == fmt and stream["export"]["model_weights"] is True
    assert stream["broadcast"]["external_world_size"] == s.inference.replicas * s.inference.tensor_parallel
    assert stream["broadcast"]["backend"] == ("nccl" if s.inference.engine == "vllm" else "gloo")
    assert stream["broadcast"]["port"] == runtime.WEIGHT_SYNC_PORT
    # Both Redis clients of Fast-LLM go to the relay in the pod, which the launcher serves at this address.
    relay = {"host": "127.0.0.1", "port": runtime.REDIS_PORT}
    assert {k: stream[k] for k in relay} == relay == {k: c["data"]["datasets"]["training"][k] for k in relay}
    # The timeouts nobody set (Fast-LLM's 600 s): the documents' and the broadcast's, from the spec.
    assert c["data"]["datasets"]["training"]["timeout"] == s.trainer.fast_llm.data_timeout_seconds
    assert stream["timeout"] == s.trainer.fast_llm.broadcast_timeout_seconds


def test_protocol_names_are_fast_llms():
    constants = {k: v["value"] for k, v in FIXTURE["constants"].items()}
    assert constants == {"REDIS_DATA_STREAM": protocol.DOCUMENTS_STREAM, "REDIS_GROUP_NAME": protocol.DOCUMENTS_GROUP,
                         "REDIS_TRAINING_STREAM": protocol.EVENTS_STREAM, "REDIS_TRAINING_FIELD": protocol.EVENT_FIELD}
    consumer = FIXTURE["evidence"]["consumer_name"]["source"]
    assert re.search(r'f"fast_llm_consumer_\{config\.rank\}"', consumer)
    assert protocol.consumer_name(3) == "fast_llm_consumer_3"


# --- the ConfigMap -----------------------------------------------------------------------------------------------


def test_config_map_holds_the_fast_llm_config_and_no_secret():
    raw = spec()
    ref = job(raw)
    children = builders.static_children(ref, password="s3cret-Pa55")
    cm = next(c for c in children if c["kind"] == "ConfigMap")
    assert set(cm["data"]) == {names.CONFIG_KEY, fastllm.CONFIG_KEY}
    assert yaml.safe_load(cm["data"][fastllm.CONFIG_KEY]) == fastllm.training_config(ref.spec, "ns", "fl")
    assert "s3cret-Pa55" not in json.dumps(cm)
    # Other backends get no Fast-LLM config.
    torch_job = job({**raw, "trainer": {"backend": "torch"}})
    assert fastllm.CONFIG_KEY not in builders.config_map(torch_job)["data"]


# --- the trainer pod -----------------------------------------------------------------------------------------------


def _split(command: list[str]) -> tuple[list[str], list[str]]:
    cut = command.index("--")
    return command[:cut], command[cut + 1:]


@pytest.mark.parametrize("nodes", [1, 3])
def test_trainer_pods_run_fast_llm_launcher_as_pipelinerl_does(nodes):
    raw = spec(trainer__nodes=nodes, trainer__checkpoint={"claimName": "shared", "path": "/ckpt"})
    ref = job(raw)
    config = fastllm.training_config(ref.spec, "ns", "fl")
    for index in range(nodes):
        pod = builders.pod(ref, "trainer", index)
        (container,) = pod["spec"]["containers"]
        ours, launcher = _split(container["command"])
        assert ours[:3] == ["python", "-m", "rlkube.core.launch.fast_llm"]
        # torch's own torchrun parser reads the launcher command.
        assert launcher[0] == "torchrun"
        args = get_args_parser().parse_args(launcher[1:])
        cfg, program, program_args = config_from_args(args)
        assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (nodes, nodes, 8)
        assert cfg.rdzv_backend == "static" and cfg.rdzv_configs["rank"] == index
        assert cfg.rdzv_endpoint == f"{names.trainer_host('fl', 0)}:{builders.MASTER_PORT}"
        assert int(cfg.rdzv_configs["timeout"]) == fastllm.RENDEZVOUS_TIMEOUT_S and cfg.max_restarts == 0
        # --no-python: the program is Fast-LLM's console script, `fast-llm = fast_llm.cli:fast_llm_main`.
        assert args.no_python and program == "fast-llm"
        assert "fast-llm = fast_llm.cli:fast_llm_main" in FIXTURE["console_scripts"]
        assert program_args == ["train", fastllm.MODEL_TYPE, "--config", fastllm.CONFIG_PATH]
        # The config file is the ConfigMap's key, mounted where the command reads it.
        mount = next(m for m in container["volumeMounts"] if m["name"] == "job-config")
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "job-config")
        assert f"{mount['mountPath']}/{fastllm.CONFIG_KEY}" == fastllm.CONFIG_PATH
        assert volume["configMap"]["name"] == names.config_name("fl")
        # Checkpoints and exports land on the checkpoint volume.
        ckpt = next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")
        assert ckpt["mountPath"] == config["run"]["experiment_dir"] == "/ckpt"
        # The relay: Fast-LLM's Redis address in, the job's Redis Service out.
        relay = f"{config['data']['datasets']['training']['host']}:{config['data']['datasets']['training']['port']}"
        assert ours[ours.index("--redis-listen") + 1] == relay
        assert ours[ours.index("--redis-upstream") + 1] == f"{names.service_name('fl', 'redis')}:{runtime.REDIS_PORT}"
        # The broadcast store: pod 0 only (global rank 0 is there: static rendezvous, node rank = pod index).
        broadcast = config["callbacks"]["streaming"]["broadcast"]
        hosts_store = "--broadcast-store-port" in ours
        assert hosts_store == (index == 0)
        if hosts_store:
            assert int(ours[ours.index("--broadcast-store-port") + 1]) == broadcast["port"]
        # Ports: the broadcast store (inference servers connect through the trainer Service) and the rendezvous.
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"weight-sync": broadcast["port"], "rendezvous": builders.MASTER_PORT}
        service = builders.service(ref, "trainer")
        assert {p["port"] for p in service["spec"]["ports"]} == set(ports.values())
        # Env: the Redis password from the job's Secret (for the relay only), Fast-LLM's PYTHONHASHSEED; torchrun
        # sets the rank variables itself, so none is given.
        env = {e["name"]: e for e in container["env"]}
        assert env[runtime.ENV_REDIS_PASSWORD]["valueFrom"]["secretKeyRef"] == {
            "name": names.secret_name("fl"), "key": names.SECRET_KEY}
        assert env["PYTHONHASHSEED"]["value"] == fastllm.PYTHONHASHSEED
        assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & set(env)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert pod["spec"]["hostname"] == names.pod_name("fl", "trainer", index)


def test_other_backends_keep_their_trainer_command():
    raw = spec(trainer__backend="torch", trainer__gpusPerNode=0)
    (container,) = builders.pod(job(raw), "trainer", 0)["spec"]["containers"]
    assert container["command"] == ["python", "-m", "rlkube.core.trainer"]


# --- specs that cannot run ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "field"), [
    ({"trainer__gpusPerNode": 0}, "spec.trainer.gpusPerNode"),
    ({"trainer__fastLlm": {}}, "spec.trainer.fastLlm.modelFormat"),
    ({"model__path": "builtin://tiny-llama"}, "spec.model.path"),
    ({"model__path": "hf://Qwen/Qwen2.5-0.5B"}, "spec.model.path"),
    ({"algorithm__loss": "ppo"}, "spec.algorithm.loss"),
    ({"trainer__nodes": 2}, "spec.trainer.checkpoint.claimName"),
    ({"redis": {"mode": "external", "url": "redis://r:6379/0"}}, "spec.redis.mode"),
])
def test_validation_refuses_fast_llm_specs_that_cannot_run(changes, field):
    with pytest.raises(SpecError) as err:
        parse_spec(spec(**changes))
    assert [e.field for e in err.value.errors] == [field], err.value


def test_a_bad_model_format_is_refused_by_the_schema():
    with pytest.raises(SpecError) as err:
        parse_spec(spec(trainer__fastLlm={"modelFormat": "gpt2"}))
    assert [e.field for e in err.value.errors] == ["spec.trainer.fastLlm.modelFormat"]
