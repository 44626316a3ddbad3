"""Write tests/fixtures/fast_llm_config_fields.json from Fast-LLM's own source: which Fast-LLM fields rlkube's
Fast-LLM config uses, their types, defaults and where Fast-LLM declares them, at one Fast-LLM commit.

Why a tool and a committed fixture: Fast-LLM needs Python >= 3.12 (and CUDA to train), rlkube runs on 3.11, so
the unit tests cannot import Fast-LLM. This tool runs where Fast-LLM's config classes can be imported (Python
3.12; they need only PyYAML, requests and numpy), walks the configs rlkube.controller.manifests.fastllm writes for the
sample specs below through Fast-LLM's config classes, and records every field it meets. With --validate it also
runs Fast-LLM's CLI validation (`fast-llm train gpt --config X --validate`, which needs torch, transformers and
safetensors, no GPU) on each sample config, `pretrained.path` pointed at a config.json-only checkpoint of the
sample's format. tests/unit/test_fast_llm_config.py then checks the generated configs against the record. It
also records, from the source text alone (`document_schema`, any Python), the document record Fast-LLM's streaming
dataset parses strictly (RedisStreamingDocumentData): tests/unit/test_fast_llm_documents.py checks every document
kind our preprocessor writes against it. And it runs Fast-LLM's own parser (RedisStreamingDocumentData.from_message,
which needs torch) on every kind of document our preprocessor writes, read from a real Redis stream (redis-server
on PATH) that our preprocessor role filled, and records its verdict on each (`document.fast_llm_parse`); it exits
non-zero when Fast-LLM refuses one, or accepts the negative control (a reward-error document as our own trainers'
entry, whose `reward_error` key Fast-LLM does not know).

    python3.12 -m venv /tmp/fl && /tmp/fl/bin/pip install pyyaml requests numpy packaging pydantic orjson redis torch
    # for --validate also: torch safetensors 'transformers>=4.57.3,<6'
    PYTHONPATH=operator /tmp/fl/bin/python tests/support/fast_llm_fields.py --fast-llm-git PATH_TO_FAST_LLM_GIT \
        [--validate] [--compare-commit OTHER_SHA] --out tests/fixtures/fast_llm_config_fields.json
"""

from __future__ import annotations

import argparse
import ast
import configparser
import copy
import dataclasses
import enum
import hashlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile
import types
import typing
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DICT_FIELDS = ("callbacks", "data.datasets", "model.base_model.head.losses")
"""Fast-LLM dict fields whose values are dynamic types: recorded as `path.<type>.field`, whatever the key."""

# A config.json per format, the smallest that Fast-LLM's importer accepts (only --validate reads them).
_HF_CONFIGS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False},
}


def samples() -> dict[str, dict]:
    """(name -> namespace, job, spec): the shipped example and a multi-node GSPO variant."""
    example = yaml.safe_load((ROOT / "examples" / "fast-llm.yaml").read_text())
    two_nodes = copy.deepcopy(example["spec"])
    two_nodes["model"]["maxSequenceLength"] = 4096
    two_nodes["algorithm"].update(loss="gspo", temperature=0.7, clipEpsilonLow=0.003, clipEpsilonHigh=0.004,
                                  samplesPerStep=512, maxSteps=400, gradClipNorm=0.3)
    two_nodes["trainer"].update(nodes=2, checkpoint={"path": "/checkpoints", "claimName": "ckpt", "intervalSteps": 20},
                                fastLlm={"modelFormat": "llama"})
    two_nodes["inference"]["replicas"] = 3
    return {
        "examples/fast-llm.yaml": {"namespace": "default", "job": example["metadata"]["name"], "spec": example["spec"]},
        "two-nodes-gspo-llama": {"namespace": "rl", "job": "gspo", "spec": two_nodes},
    }


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def build_configs() -> dict[str, dict]:
    from rlkube.lifecycle.validation import parse_spec
    from rlkube.controller.manifests import fastllm

    out = {}
    for name, sample in samples().items():
        spec = parse_spec(sample["spec"])
        out[name] = fastllm.training_config(spec, sample["namespace"], sample["job"])
    return out


# --- Fast-LLM side ------------------------------------------------------------------------------------------


def _extract(git_dir: str, commit: str, dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", git_dir, "archive", "--format=tar", commit], check=True,
                             capture_output=True).stdout
    tar = dest / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as tf:
        tf.extractall(dest / "src", filter="data")
    return dest / "src"


def _import_fast_llm(src: Path):
    sys.path.insert(0, str(src))
    import fast_llm.data.auto  # noqa: F401  (fills the dynamic-type registries, as fast_llm/cli.py does)
    import fast_llm.engine.checkpoint.convert  # noqa: F401
    import fast_llm.models.auto  # noqa: F401
    from fast_llm.models.gpt.config import GPTModelConfig, GPTTrainerConfig

    return GPTTrainerConfig, GPTModelConfig


def _declaration(cls: type, name: str, src: Path) -> tuple[dict, dict]:
    """(most-derived, base-most) declaration of field `name` along cls's MRO: class, file, line."""
    found = []
    for klass in cls.__mro__:
        try:
            lines, start = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        pattern = re.compile(rf"^    {re.escape(name)}\s*[:=]")
        for i, line in enumerate(lines):
            if pattern.match(line):
                file = Path(inspect.getsourcefile(klass)).resolve().relative_to(src.resolve())
                found.append({"class": f"{klass.__module__}.{klass.__qualname__}", "file": str(file),
                              "line": start + i})
                break
    if not found:
        raise LookupError(f"no declaration of {name!r} in the MRO of {cls}")
    return found[0], found[-1]


def _unwrap(annotation) -> tuple[typing.Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(args)
    return annotation, False


def _kind(annotation, model_config) -> dict:
    from fast_llm.engine.checkpoint.config import CheckpointFormat

    inner, nullable = _unwrap(annotation)
    out: dict[str, typing.Any] = {"nullable": nullable}
    if inner in (bool, int, float, str):
        out["kind"] = inner.__name__
    elif inner is pathlib.Path:
        out["kind"] = "path"
    elif isinstance(inner, type) and issubclass(inner, enum.Enum):
        out["kind"], out["choices"] = "enum", [m.value for m in inner]
    elif typing.get_origin(inner) is type and issubclass(typing.get_args(inner)[0], CheckpointFormat):
        out["kind"], out["choices"] = "checkpoint_format", [f.name for f in model_config.checkpoint_formats]
    else:
        raise TypeError(f"no kind for annotation {annotation!r}")
    return out


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, type):
        return getattr(value, "name", value.__name__)
    if isinstance(value, pathlib.Path):
        return str(value)
    return value


def record_fields(configs: dict[str, dict], src: Path) -> tuple[dict, dict, list[str]]:
    """Walk each config through Fast-LLM's classes; return (fields, dynamic types, paths Fast-LLM lacks)."""
    trainer_cls, model_cls = _import_fast_llm(src)
    from fast_llm.config import Config
    from fast_llm.utils import get_type_name

    fields: dict[str, dict] = {}
    dynamic: dict[str, dict] = {}
    missing: list[str] = []

    def walk(cls: type, value: dict, path: str) -> None:
        if "type" in value:
            cls = cls.get_subclass(value["type"])
        for key, sub in value.items():
            where = f"{path}.{key}" if path else key
            field = cls.__dataclass_fields__.get(key)
            if field is None or not field.init:
                missing.append(where)
                continue
            annotation, _ = _unwrap(field.type)
            if where in DICT_FIELDS:
                (value_cls,) = typing.get_args(annotation)[1:]
                base = value_cls if isinstance(value_cls, type) else typing.get_origin(value_cls)
                dynamic[where] = {"base_class": f"{base.__module__}.{base.__qualname__}",
                                  "types": sorted(base._registry) if base._registry is not None else []}
                for entry in sub.values():
                    walk(base, entry, f"{where}.<{entry['type']}>")
                continue
            base = annotation if isinstance(annotation, type) else typing.get_origin(annotation)
            if isinstance(base, type) and issubclass(base, Config):
                walk(base, sub, where)
                continue
            declared, origin = _declaration(cls, key, src)
            entry = {"owner": f"{cls.__module__}.{cls.__qualname__}", "declared": declared,
                     "type": get_type_name(field.type) if isinstance(field.type, type) else str(field.type),
                     "default": _default(field)}
            if origin != declared:
                entry["type_declared"] = origin
            if key == "type":
                root = next(k for k in cls.__mro__ if getattr(k, "_registry", None) is not None)
                entry.update(kind="dynamic_type", nullable=True, choices=sorted(root._registry))
            else:
                entry.update(_kind(field.type, model_cls))
            fields[where] = entry

    for config in configs.values():
        walk(trainer_cls, config, "")
    return dict(sorted(fields.items())), dict(sorted(dynamic.items())), sorted(set(missing))


def _constant(src: Path, file: str, name: str) -> dict:
    tree = ast.parse((src / file).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return {"value": ast.literal_eval(node.value), "file": file, "line": node.lineno}
    raise LookupError(f"{name} not in {file}")


def _line(src: Path, file: str, needle: str) -> dict:
    for number, line in enumerate((src / file).read_text().splitlines(), 1):
        if needle in line:
            return {"source": line.strip(), "file": file, "line": number}
    raise LookupError(f"{needle!r} not in {file}")


def wire_facts(src: Path) -> dict:
    """What our side relies on besides the config: names, the entry point, the Redis client, the save layout."""
    setup = configparser.ConfigParser()
    setup.read(src / "setup.cfg")
    scripts = [s.strip() for s in setup["options.entry_points"]["console_scripts"].splitlines() if s.strip()]
    return {
        "console_scripts": scripts,
        "python_requires": setup["options"]["python_requires"],
        "streaming_extra": [r.strip() for r in setup["options.extras_require"]["STREAMING"].splitlines() if r.strip()],
        "constants": {
            "REDIS_DATA_STREAM": _constant(src, "fast_llm/data/dataset/config.py", "REDIS_DATA_STREAM"),
            "REDIS_GROUP_NAME": _constant(src, "fast_llm/data/dataset/config.py", "REDIS_GROUP_NAME"),
            "REDIS_TRAINING_STREAM": _constant(src, "fast_llm/engine/training/streaming.py", "REDIS_TRAINING_STREAM"),
            "REDIS_TRAINING_FIELD": _constant(src, "fast_llm/engine/training/streaming.py", "REDIS_TRAINING_FIELD"),
        },
        "evidence": {
            "redis_client_has_no_password": _line(src, "fast_llm/data/dataset/config.py", "return redis.Redis("),
            "streaming_dataset_client": _line(src, "fast_llm/data/dataset/streaming.py", "client = redis.Redis("),
            "consumer_name": _line(src, "fast_llm/data/dataset/streaming.py", "consumername="),
            "broadcast_rendezvous": _line(src, "fast_llm/engine/training/streaming.py", 'init_method = f"tcp://'),
            "broadcast_world_size": _line(src, "fast_llm/engine/training/streaming.py", "external_world_size + 1"),
            "tcp_rendezvous": _line(src, "fast_llm/engine/distributed/distributed.py", "torch.distributed.rendezvous("),
            "checkpoint_directory": _line(src, "fast_llm/engine/training/config.py", 'experiment_directory / "checkpoint"'),
            "export_directory": _line(src, "fast_llm/engine/training/config.py", 'experiment_directory / "export"'),
            "resume_from_last_checkpoint": _line(src, "fast_llm/engine/training/trainer.py",
                                                 "if (last_iteration := self._get_last_checkpoint()) is None"),
            "training_finished_after_run": _line(src, "fast_llm/engine/training/trainer.py", "callback.train_end("),
            "one_loader_per_rank": _line(src, "fast_llm/data/dataset/streaming.py", "worker_info.num_workers > 1"),
            "pythonhashseed_warning": _line(src, "fast_llm/utils.py", "PYTHONHASHSEED should be set"),
        },
    }


def document_schema(src: Path) -> dict:
    """The document record Fast-LLM's streaming dataset parses (RedisStreamingDocumentData): its fields, each
    field's declared type, and the lines that make the parse strict. Read from the source text (the module uses
    Python 3.12 syntax elsewhere, so only the class is parsed): no import, so it runs on any Python."""
    file = "fast_llm/data/dataset/streaming.py"
    text = (src / file).read_text()
    start = text.index("class RedisStreamingDocumentData(")
    end = text.index("\n    def ", start)
    first = text.count("\n", 0, start) + 1
    cls = ast.parse(text[start:end]).body[0]
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            required = isinstance(node.value, ast.Call) and not any(k.arg == "default" for k in node.value.keywords)
            fields[node.target.id] = {"type": ast.unparse(node.annotation), "required": required,
                                      "file": file, "line": first + node.lineno - 1}
    return {
        "class": "fast_llm.data.dataset.streaming.RedisStreamingDocumentData",
        "fields": fields,
        # Every stream field but `data` becomes a keyword, `data` is JSON whose keys become keywords; from_dict
        # is strict by default and refuses a keyword that is not a field ("Unknown field").
        "evidence": {
            "message_fields_are_keywords": _line(src, file, "kwargs[key] = value"),
            "data_keys_are_keywords": _line(src, file, "kwargs.update(json.loads(value))"),
            "parsed_with_from_dict": _line(src, file, "return cls.from_dict(kwargs)"),
            "from_dict_strict_default": _line(src, "fast_llm/config.py", "strict: bool = True,"),
            "strict_refuses_leftovers": _line(src, "fast_llm/config.py", "if strict and default:"),
            "unknown_field_error": _line(src, "fast_llm/config.py", "Unknown field"),
            "tokens_int64": _line(src, file, "self.tokens = torch.frombuffer(self.tokens, dtype=torch.int64)"),
            "old_log_probabilities_float32": _line(
                src, file, "torch.frombuffer(self.old_log_probabilities, dtype=torch.float32)"),
            "model_version_int64": _line(src, file, "torch.frombuffer(self.model_version, dtype=torch.int64)"),
            "model_version_units": _line(src, file, "# Model version each token was generated under"),
            "staleness_is_documents_seen_minus_model_version": _line(
                src, "fast_llm/layers/language_model/loss/policy_gradient.py", "documents_seen - model_version"),
            "documents_seen_counts_every_step": _line(
                src, "fast_llm/engine/training/trainer.py", "self._documents_seen += step_num_documents"),
            "redis_timeout_default": _line(src, "fast_llm/data/dataset/config.py", "timeout: float = Field(default="),
            "data_timeout": _line(src, file, "> self._config.timeout"),
            "broadcast_timeout": _line(src, "fast_llm/engine/training/streaming.py", "timeout=self._config.timeout"),
            "no_weights_ready_when_skipped": _line(src, "fast_llm/engine/training/streaming.py", "if update_successful"),
        },
    }


# --- our documents through Fast-LLM's own parser ---------------------------------------------------------------

PROMPT = [1, 5, 6]
ANNOUNCED = ((0, 0), (1, 8), (2, 17))
"""(step, documents_seen) of the weights_ready events Fast-LLM publishes before the corpus: documents seen, not
steps (a step of 8 documents, then one of 9)."""


def _sample(n: int, reward: float, **kw):
    from rlkube.contract import protocol

    return protocol.Sample([20 + i for i in range(n)], [-0.25] * n, reward, **kw)


def document_groups() -> dict:
    """One rollout group per kind of document a fast-llm job's preprocessor writes (tests/unit/
    test_fast_llm_documents.py writes the same corpus), sampled with versions 0..2."""
    from rlkube.contract import protocol

    return {
        "single-turn": protocol.RolloutGroup("single", PROMPT, [_sample(2, 1.0), _sample(3, 0.0)], model_version=1,
                                             expected_size=2),
        # an episode: environment turns masked like the prompt, tokens sampled by two versions
        "multi-turn": protocol.RolloutGroup("episode", PROMPT, [
            _sample(8, 1.0, env_spans=[(2, 5)], versions=[1, 1, 1, 1, 1, 2, 2, 2], episode={"turns": 2.0}),
            _sample(8, 0.0, env_spans=[(3, 6)], versions=[2] * 8, episode={"turns": 2.0})],
            model_version=1, expected_size=2),
        "reward error": protocol.RolloutGroup("failed", PROMPT, [_sample(2, 0.0, reward_error=True),
                                                                 _sample(2, 1.0)], model_version=2, expected_size=2),
        "truncated": protocol.RolloutGroup("cut", PROMPT, [_sample(4, 0.0, finished=False), _sample(2, 1.0)],
                                           model_version=0, expected_size=2),
        # written only with filterZeroAdvantageGroups off (on, the default, the group becomes no document)
        "zero advantage": protocol.RolloutGroup("flat", PROMPT, [_sample(3, 1.0), _sample(3, 1.0)],
                                                model_version=2, expected_size=2),
    }


def document_corpus() -> list[tuple[str, dict[bytes, bytes]]]:
    """(kind, stream entry) of every document in a real Redis stream that our preprocessor role filled for the
    shipped fast-llm example (groupSize 2, samplesPerStep 8, zero-advantage groups kept): the entries exactly as
    Fast-LLM's streaming dataset reads them (XREADGROUP, bytes keys and values). Then two kinds written by our
    encoder alone: an SFT row (validation refuses loss sft for fast-llm, so a fast-llm job writes none; encoded
    the same way) and the negative control, the reward-error document as our own trainers' entry."""
    import numpy as np

    from rlkube.contract import protocol
    from rlkube.contract.context import RoleContext
    from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
    from rlkube.core.preprocessor.role import PreprocessorRole
    from rlkube.lifecycle.validation import parse_spec
    from rlkube.local.redis_server import RedisServer

    raw = copy.deepcopy(samples()["examples/fast-llm.yaml"]["spec"])
    raw["algorithm"].update(groupSize=2, samplesPerStep=8, filterZeroAdvantageGroups=False)
    spec = parse_spec(raw)
    groups = document_groups()
    corpus: list[tuple[str, dict[bytes, bytes]]] = []
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        client = server.client()
        ctx = RoleContext("ns", "job", spec, server.url)
        role = PreprocessorRole(ctx, client, max_ahead=10_000)
        for step, seen in ANNOUNCED:
            client.xadd(ctx.keys.events, protocol.encode_event(protocol.WEIGHTS_READY, step=step,
                                                               documents_seen=seen))
        for group in groups.values():
            client.xadd(ctx.keys.rollouts, group.encode())
        for _ in range(len(groups)):
            role.poll()
        # Fast-LLM's read (fast_llm/data/dataset/streaming.py): a consumer group on the stream, XREADGROUP.
        client.xgroup_create(ctx.keys.documents, "fast_llm_group", id="0", mkstream=True)
        read = client.xreadgroup("fast_llm_group", "fast_llm_consumer_0", {ctx.keys.documents: ">"}, count=1000)
        entries = [fields for _, messages in read for _, fields in messages]
        kinds = [kind for kind, group in groups.items() for _ in group.samples]
        if len(entries) != len(kinds):
            raise SystemExit(f"the preprocessor wrote {len(entries)} documents for {len(kinds)} samples")
        corpus += list(zip(kinds, entries, strict=True))
        client.close()
    row = protocol.RolloutGroup("row", PROMPT, [_sample(5, 0.0)], model_version=0, expected_size=1)
    sft = group_to_documents(row, DocumentConfig(drop_singletons=False, documents_per_version=8))[0]
    corpus.append(("sft row", {k.encode(): v for k, v in protocol.encode_document(sft, ours=False).items()}))
    failed = protocol.Document(np.arange(4, dtype=np.int64), [(0, 2)], 0.5, 1.0, reward_error=True)
    corpus.append(("negative control: reward error as our trainers' entry",
                   {k.encode(): v for k, v in protocol.encode_document(failed).items()}))
    return corpus


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def parse_documents(corpus: list[tuple[str, dict[bytes, bytes]]], src: Path) -> list[dict]:
    """Fast-LLM's own RedisStreamingDocumentData.from_message (strict from_dict, then its _validate: tensors
    decoded, lengths checked) on every entry of the corpus; its verdict and what it parsed."""
    sys.path.insert(0, str(src))
    from fast_llm.data.dataset.streaming import RedisStreamingDocumentData

    verdicts = []
    for kind, message in corpus:
        entry = {"kind": kind, "stream_fields": sorted(k.decode() for k in message)}
        if b"data" in message:
            entry["data_keys"] = sorted(json.loads(message[b"data"]))
        try:
            parsed = RedisStreamingDocumentData.from_message(message)
            parsed.to_document()  # what the dataset does next with it
        except Exception as exc:  # noqa: BLE001 - the verdict is what is recorded
            entry.update(accepted=False, error=f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
        else:
            entry["accepted"] = True
            entry["parsed"] = {name: _plain(getattr(parsed, name))
                               for name, field in type(parsed).__dataclass_fields__.items()
                               if field.init and not name.startswith("_") and getattr(parsed, name) is not None}
            entry["parsed"]["tokens_dtype"] = str(parsed.tokens.dtype)
        verdicts.append(entry)
    return verdicts


def _torch_version() -> str:
    import torch

    return torch.__version__


def _fast_llm_validate(config: dict, path: Path, src: Path, work: Path, world: tuple[int, int]) -> subprocess.CompletedProcess:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "fast_llm.cli", "train", "gpt", "--config", str(path), "--validate"]
    # The environment torchrun gives rank 0 of this job (Fast-LLM's DistributedConfig reads it).
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "42", "RANK": "0",
           "WORLD_SIZE": str(world[0] * world[1]), "LOCAL_WORLD_SIZE": str(world[1])}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work)


def validate(configs: dict[str, dict], src: Path, work: Path) -> dict[str, dict]:
    """Fast-LLM's own CLI validation (no run) of each config; raises on the first one it refuses. A copy with a
    misspelt field must be refused first, or the check proves nothing."""
    results = {}
    specs = samples()
    for name, config in configs.items():
        fmt = config["pretrained"]["format"]
        model = work / f"model-{fmt}"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(_HF_CONFIGS[fmt]))
        checked = copy.deepcopy(config)
        checked["pretrained"]["path"] = str(model)
        checked["run"]["experiment_dir"] = str(work / "experiment")
        trainer = specs[name]["spec"]["trainer"]
        world = (trainer.get("nodes", 1), trainer.get("gpusPerNode", 0))
        stem = re.sub(r"[^A-Za-z0-9]+", "-", name)
        broken = copy.deepcopy(checked)
        broken["schedule"]["docs_per_stepp"] = broken["schedule"].pop("docs_per_step")
        refused = _fast_llm_validate(broken, work / f"{stem}-broken.yaml", src, work, world)
        if refused.returncode == 0 or "docs_per_stepp" not in refused.stdout + refused.stderr:
            raise SystemExit(f"Fast-LLM accepted a misspelt field in {name}: the validation checks nothing")
        out = _fast_llm_validate(checked, work / f"{stem}.yaml", src, work, world)
        if out.returncode != 0:
            raise SystemExit(f"Fast-LLM refused {name}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        results[name] = {
            "command": "fast-llm train gpt --config <config> --validate",
            "environment": {"RANK": "0", "WORLD_SIZE": str(world[0] * world[1]), "LOCAL_WORLD_SIZE": str(world[1])},
            "returncode": 0,
            "negative_control": "the same config with schedule.docs_per_stepp: refused (Unknown field)",
            "overridden_for_validation": {"pretrained.path": f"a config.json-only {fmt} checkpoint",
                                          "run.experiment_dir": "a temporary directory"},
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast-llm-git", required=True, help="a git directory of ServiceNow/Fast-LLM (bare is fine)")
    parser.add_argument("--commit", help="default: rlkube.controller.manifests.fastllm.FAST_LLM_COMMIT")
    parser.add_argument("--validate", action="store_true", help="also run Fast-LLM's CLI validation")
    parser.add_argument("--compare-commit", help="also list the recorded fields another Fast-LLM commit lacks")
    parser.add_argument("--fields-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if sys.version_info < (3, 12):
        raise SystemExit("Fast-LLM's source needs Python >= 3.12")
    from rlkube.controller.manifests import fastllm

    commit = args.commit or fastllm.FAST_LLM_COMMIT
    commit = subprocess.run(["git", "-C", args.fast_llm_git, "rev-parse", f"{commit}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    configs = build_configs()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        src = _extract(args.fast_llm_git, commit, work)
        fields, dynamic, missing = record_fields(configs, src)
        if args.fields_only:
            json.dump({"fields": sorted(fields), "missing": missing}, sys.stdout)
            return 0
        if missing:
            raise SystemExit(f"Fast-LLM {commit} has no field {', '.join(missing)}")
        verdicts = parse_documents(document_corpus(), src)
        for v in verdicts:
            print(f"from_message {v['kind']!r}: {'accepted' if v['accepted'] else 'REFUSED ' + v['error']}; "
                  f"fields {v['stream_fields']} data {v.get('data_keys', [])}", file=sys.stderr)
        if not all(v["accepted"] for v in verdicts if not v["kind"].startswith("negative control")):
            raise SystemExit("Fast-LLM refused a document our preprocessor writes (see above)")
        if any(v["accepted"] for v in verdicts if v["kind"].startswith("negative control")):
            raise SystemExit("Fast-LLM accepted the negative control: the parse checks nothing")
        record = {
            "fast_llm": {"repository": fastllm.FAST_LLM_REPOSITORY, "commit": commit},
            "how": "written by tests/support/fast_llm_fields.py from Fast-LLM's config classes at this commit",
            "entry": {"model_type": fastllm.MODEL_TYPE, "config_class": "fast_llm.models.gpt.config.GPTTrainerConfig"},
            "dict_fields": dynamic,
            "fields": fields,
            **wire_facts(src),
            "document": {**document_schema(src), "fast_llm_parse": {
                "how": "each document from a real Redis stream our preprocessor role filled (XREADGROUP, as Fast-LLM "
                       "reads it) through Fast-LLM's own RedisStreamingDocumentData.from_message and to_document, "
                       f"Fast-LLM at this commit, Python {sys.version.split()[0]}, torch {_torch_version()}",
                "verdicts": verdicts}},
            "samples": {name: {**sample, "config_sha256": config_sha256(configs[name])}
                        for name, sample in samples().items()},
        }
        if args.validate:
            for name, result in validate(configs, src, work).items():
                record["samples"][name]["fast_llm_validate"] = result
        if args.compare_commit:
            other = subprocess.run([sys.executable, __file__, "--fast-llm-git", args.fast_llm_git, "--commit",
                                    args.compare_commit, "--fields-only"], check=False, capture_output=True,
                                   text=True, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
            other_commit = subprocess.run(["git", "-C", args.fast_llm_git, "rev-parse", args.compare_commit],
                                          check=True, capture_output=True, text=True).stdout.strip()
            if other.returncode != 0:
                raise SystemExit(f"field extraction at {args.compare_commit} failed:\n{other.stderr[-3000:]}")
            there = json.loads(other.stdout)
            record["compared_with"] = {"commit": other_commit, "fields_missing_there": there["missing"]}
    text = json.dumps(record, indent=1, default=str) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
