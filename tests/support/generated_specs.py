"""Hypothesis strategies for TrainingJob specs, valid and invalid, each with what the system must do with it.

Valid specs are drawn from the CRD's OpenAPI schema (generated from the pydantic types, so the model drives
them): every field optional or not, enums, numbers from their minimum up to their maximum (pod counts kept small:
the test cluster has no kubelet and each pod is a real API object), then made to satisfy the rules the schema
cannot express, restated here from docs/design.md §2.4 rather than imported from rlkube.lifecycle.validation.

A case mutates such a spec and says what must happen (`Case.expect`):
- "schema": the API server answers 422 naming each mutated path (wrong JSON type, below minimum or above
  maximum, unknown enum value, missing required field, pattern, empty string where one character is required);
- "operator": the API server accepts it, and the operator fails the job InvalidSpec naming the field and creates
  nothing (cross-field rules, resource quantities, task params of a type the schema lets through);
- "valid": accepted and run (unknown fields are pruned, not refused);
- "edge": values both validators let through that a Pod or Service may refuse (whitespace around an image, a
  mount path the pod already uses, Secret key syntax, extended-resource quantities, long or dotted job names):
  the operator either runs the job or fails it InvalidSpec naming the field, and no child is left.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from rlkube.api.crd import crd
from rlkube.api.model_path import BUILTIN_ATTENTION_HEADS, parse_model_path
from rlkube.contract.parallel import tensor_parallel_heads_error
from rlkube.lifecycle.image_reference import reference_error
from support.specs import DELETE, with_overrides

SPEC_SCHEMA: dict = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
ROLES = ("trainer", "inference", "actor", "preprocessor")

# Pod counts and the shape of the built-in model stay small: every pod is a real object in the API server.
SMALL = {
    "trainer.nodes": 2, "inference.replicas": 2, "actor.replicas": 2, "preprocessor.replicas": 1,
    "inference.tensorParallel": 2, "trainer.gpusPerNode": 2,
}
ASCII_NAME = st.text("abcdefghijklmnopqrstuvwxyz0123456789-./:_", min_size=1, max_size=20)


@dataclass
class Case:
    spec: dict
    expect: str  # "valid" | "schema" | "operator" | "edge"
    fields: list[str] = field(default_factory=list)
    """Field paths (spec.a.b) the answer must name."""
    what: list[str] = field(default_factory=list)
    """The mutations, for the summary and failure messages."""
    name: str | None = None
    """A job name of its own (edge cases); None: the test picks a plain unique one."""


# -- walking the schema -----------------------------------------------------------------------------------


def _leaves(node: dict, path: str = "") -> list[tuple[str, dict]]:
    """(dotted path under spec, schema node) of every field with a type, objects included."""
    out = []
    for key, sub in node.get("properties", {}).items():
        p = f"{path}.{key}" if path else key
        out.append((p, sub))
        if sub.get("type") == "object":
            out += _leaves(sub, p)
    return out


LEAVES = _leaves(SPEC_SCHEMA)
SCALARS = [(p, n) for p, n in LEAVES if n.get("type") in ("integer", "number", "string", "boolean")]
OBJECTS = [(p, n) for p, n in LEAVES if n.get("type") == "object"]


def _integer(path: str, node: dict) -> st.SearchStrategy[int]:
    lo = node.get("minimum", 0) + (1 if node.get("exclusiveMinimum") else 0)
    if path in SMALL:
        return st.integers(lo, SMALL[path])
    hi = node.get("maximum", 2**53)
    return st.one_of(st.integers(lo, min(hi, lo + 50)), st.integers(lo, hi), st.just(hi))


def _number(node: dict) -> st.SearchStrategy[float]:
    lo = node.get("minimum", 0.0)
    return st.floats(min_value=lo, max_value=node.get("maximum", 1e6), exclude_min=bool(node.get("exclusiveMinimum")),
                     exclude_max=bool(node.get("exclusiveMaximum")), allow_nan=False, allow_infinity=False)


def _string(path: str, node: dict) -> st.SearchStrategy[str]:
    if "pattern" in node:
        # The API server's regexes are Go RE2, where \w is ASCII only.
        return st.from_regex(node["pattern"], fullmatch=True, alphabet=st.characters(codec="ascii",
                                                                                     categories=["L", "N", "P"]))
    return ASCII_NAME if path.endswith(("image", "name", "claimName", "key")) else st.text(
        st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=node.get("minLength", 0), max_size=20)


quantities = st.one_of(st.integers(0, 64), st.sampled_from(["500m", "1", "2", "0.5", "1Gi", "512Mi", "1e3", "100M"]))
params_values = st.one_of(st.integers(-(2**53), 2**53), st.booleans(), st.text(max_size=10),
                          st.floats(allow_nan=False, allow_infinity=False))


def _value(path: str, node: dict) -> st.SearchStrategy:
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if path.endswith(("resources.requests", "resources.limits")):
        return st.dictionaries(st.sampled_from(["cpu", "memory", "ephemeral-storage"]), quantities, max_size=2)
    if path in ("task.params", "task.environment.params"):
        return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5), params_values, max_size=3)
    if path == "task.reasoningGym.config":  # a reasoning-gym task's config fields: scalars or lists of them
        return st.dictionaries(st.text("abcdefgh", min_size=1, max_size=5),
                               st.one_of(params_values, st.lists(params_values, max_size=3)), max_size=3)
    kind = node.get("type")
    if kind == "integer":
        return _integer(path, node)
    if kind == "number":
        return _number(node)
    if kind == "boolean":
        return st.booleans()
    if kind == "string":
        return _string(path, node)
    if kind == "array" and node.get("items", {}).get("type") == "string" and path.endswith("targetModules"):
        # trainer.lora.targetModules: module names of the model (the schema wants at least one)
        return st.lists(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
                        min_size=max(node.get("minItems", 0), 1), max_size=3, unique=True)
    if kind == "array" and node.get("items", {}).get("type") == "string":
        # inference.vllm.extraEngineArgs: the operator passes them through (vLLM's own parser judges them in the
        # pod), so flags of the form users write them
        return st.lists(st.sampled_from(["--max-num-seqs=64", "--seed=3", "--swap-space=1", "--block-size=16"]),
                        max_size=3)
    if kind == "object":
        # Pod templates have their own rules and tests (test_controller_builders, test_chart): left to the defaults
        # here; schema mutations still reach into them (LEAVES).
        props = {k: v for k, v in node.get("properties", {}).items() if k != "template"}
        required = set(node.get("required", ()))
        return st.fixed_dictionaries(
            {k: _value(f"{path}.{k}" if path else k, v) for k, v in props.items() if k in required},
            optional={k: _value(f"{path}.{k}" if path else k, v) for k, v in props.items() if k not in required},
        )
    raise ValueError(f"no strategy for {path}: {node}")


# -- the rules the schema cannot express (docs/design.md §2.4), restated ---------------------------------


def _get(spec: dict, path: str) -> Any:
    node: Any = spec
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _set(spec: dict, path: str, value: Any) -> None:
    with_overrides(spec, {path: value})


def _drop(spec: dict, path: str) -> None:
    with_overrides(spec, {path: DELETE})


def _default(path: str) -> Any:
    node: Any = SPEC_SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node.get("default")


def _eff(spec: dict, path: str) -> Any:
    value = _get(spec, path)
    return _default(path) if value is None else value


def make_valid(spec: dict, redis_url: str, external: bool) -> dict:
    """Repair a schema-valid spec so that it also runs: the cross-field rules, and the Redis the test provides."""
    spec = copy.deepcopy(spec)
    try:
        parse_model_path(_eff(spec, "model.path"))
    except ValueError:  # a directory, hf://org/name[@rev] or a known builtin:// (random strings with :// are not)
        _set(spec, "model.path", "builtin://tiny-llama")
    # Images follow the container reference grammar (lifecycle/image_reference.py); random ASCII rarely does.
    for where in ("image", "redis.image", "sandbox.image", *(f"{role}.image" for role in (
            "trainer", "inference", "actor", "preprocessor"))):
        if (image := _get(spec, where)) is not None and reference_error(image) is not None:
            _set(spec, where, "ghcr.io/rlkube/core:0.1.0")
    # Dataset tasks have rules of their own (tests/unit/test_task_spec.py): these cases use built-in tasks.
    _drop(spec, "task.dataset")
    _drop(spec, "task.reward")
    _drop(spec, "evaluation.split")  # a split of task.dataset, dropped above (validation.evaluation_errors)
    if _get(spec, "task.reasoningGym") is not None:  # the one prompt source (validation.task_errors)
        _drop(spec, "task.entryPoint")
        _drop(spec, "task.params")
        for key in ("seed", "size"):  # rlkube sets them (validation.REASONING_GYM_RESERVED)
            _drop(spec, f"task.reasoningGym.config.{key}")
    if _eff(spec, "algorithm.loss") == "sft":  # it reads a dataset's completion column (validation.sft_errors)
        _set(spec, "algorithm.loss", "grpo")
    if _get(spec, "task.environment") is not None:  # one source; a budget within maxSequenceLength
        if _get(spec, "task.environment.name") is None:
            _set(spec, "task.environment.name", "calculator")
        _drop(spec, "task.environment.entryPoint")
        _drop(spec, "task.reasoningGym")  # a built-in environment draws its own prompts: the one source
        _drop(spec, "task.entryPoint")
        budget, limit = _get(spec, "task.environment.maxEpisodeTokens"), _eff(spec, "model.maxSequenceLength")
        if budget is not None and limit is not None and budget > limit:
            _drop(spec, "task.environment.maxEpisodeTokens")
    backend = _eff(spec, "trainer.backend")
    if backend == "fast-llm":  # its own Redis and GPUs, a Hugging Face checkpoint, its losses, vLLM
        external = False
        if _eff(spec, "trainer.gpusPerNode") < 1:
            _set(spec, "trainer.gpusPerNode", 1)
        if _get(spec, "trainer.fastLlm.modelFormat") is None:
            _set(spec, "trainer.fastLlm.modelFormat", "llama")
        if _eff(spec, "model.path").startswith("builtin://"):
            _set(spec, "model.path", "/models/llama")
        if _eff(spec, "algorithm.loss") not in ("grpo", "gspo"):
            _set(spec, "algorithm.loss", "grpo")
        _set(spec, "inference.engine", "vllm")
        if _eff(spec, "trainer.nodes") > 1 and not _get(spec, "trainer.checkpoint.claimName"):
            _set(spec, "trainer.checkpoint.claimName", "shared-checkpoints")
        _drop(spec, "tracking")  # Fast-LLM's own trainer logs to its own trackers (validation)
        if _eff(spec, "trainer.fastLlm.broadcastTimeoutSeconds") <= _eff(spec, "trainer.fastLlm.dataTimeoutSeconds"):
            _drop(spec, "trainer.fastLlm.broadcastTimeoutSeconds")  # it must outlast the data wait (validation)
            _drop(spec, "trainer.fastLlm.dataTimeoutSeconds")
    if _eff(spec, "sandbox.mode") == "pods":  # validation.sandbox_errors: an environment, and every pod limit
        if _get(spec, "task.environment") is None:
            _set(spec, "sandbox.mode", "process")
        else:
            limits = {"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}
            _set(spec, "sandbox.resources.limits", {**limits, **(_get(spec, "sandbox.resources.limits") or {})})
    if external:
        _set(spec, "redis.mode", "external")
        _set(spec, "redis.url", redis_url)
        _drop(spec, "redis.passwordSecret")  # the test's Redis has no password and there is no such Secret
    else:
        _set(spec, "redis.mode", "managed")
        _drop(spec, "redis.url")
    if _eff(spec, "algorithm.loss") != "sft" and _eff(spec, "algorithm.groupSize") < 2:
        _set(spec, "algorithm.groupSize", 2)
    if _get(spec, "trainer.processesPerNode") is not None:  # one rank per GPU; fast-llm starts its own
        if backend == "fast-llm":
            _drop(spec, "trainer.processesPerNode")
        elif _eff(spec, "trainer.gpusPerNode"):
            _set(spec, "trainer.processesPerNode", _eff(spec, "trainer.gpusPerNode"))
        else:
            _set(spec, "trainer.processesPerNode", min(_get(spec, "trainer.processesPerNode"), 2))
    ranks = _eff(spec, "trainer.nodes") * (_get(spec, "trainer.processesPerNode") or _eff(spec, "trainer.gpusPerNode")
                                           or 1)
    if _get(spec, "trainer.sharding") == "fsdp":  # the torch backend over several ranks sharing a checkpoint claim
        if backend != "torch" or ranks < 2:
            _drop(spec, "trainer.sharding")
        elif _eff(spec, "trainer.nodes") > 1 and not _get(spec, "trainer.checkpoint.claimName"):
            _set(spec, "trainer.checkpoint.claimName", "shared-checkpoints")
    if _get(spec, "trainer.cpuOffload") and _get(spec, "trainer.sharding") != "fsdp":
        _drop(spec, "trainer.cpuOffload")  # it offloads FSDP2's shards
    # The loss extensions and LoRA (lifecycle/validation.py: loss_extension_errors, lora_errors, sft_errors).
    sharded = _get(spec, "trainer.sharding") == "fsdp"
    if _eff(spec, "algorithm.offPolicyCorrection.mode") != "mis":
        _drop(spec, "algorithm.offPolicyCorrection.lower")  # mis's lower bound
    if backend == "fast-llm":
        _drop(spec, "algorithm.offPolicyCorrection")  # Fast-LLM computes its own loss
    if _eff(spec, "algorithm.klCoef") > 0 and (backend != "torch" or sharded):
        _drop(spec, "algorithm.klCoef")  # the frozen reference: the unsharded torch backend's
    if _get(spec, "trainer.lora") is not None and backend != "torch":
        _drop(spec, "trainer.lora")  # PEFT on the torch backend, unsharded or with FSDP
    tp = _get(spec, "trainer.megatron.tensorParallel")
    if tp is not None and tp > 1 and (backend != "megatron" or ranks % tp):
        _drop(spec, "trainer.megatron.tensorParallel")  # megatron's, and a divisor of the trainer's ranks
    if _eff(spec, "algorithm.samplesPerStep") < ranks:
        _set(spec, "algorithm.samplesPerStep", ranks)
    if _eff(spec, "algorithm.clipEpsilonLow") >= 1:
        _set(spec, "algorithm.clipEpsilonLow", 0.5)
    if _eff(spec, "algorithm.lrSchedule") != "constant" and _eff(spec, "algorithm.warmupSteps") >= _eff(
            spec, "algorithm.maxSteps"):
        _set(spec, "algorithm.warmupSteps", 0)  # a decaying schedule needs steps after the warm-up
    path = _eff(spec, "trainer.checkpoint.path")
    taken = ("/etc/rlkube", "/tmp", "/dev/shm", "/var/cache/rlkube/models")  # config, tmp, shm, model cache mounts
    if not path.startswith("/") or path.rstrip("/") in taken:  # absolute, not a mount the pods already have
        _set(spec, "trainer.checkpoint.path", "/ckpt" + path.rstrip("/"))
    if _get(spec, "model.claimName"):
        # A claim holds a model directory below its mountPath, which takes no path the pods already use.
        mount = _eff(spec, "model.mountPath").rstrip("/")
        if mount in ("", *taken, _eff(spec, "trainer.checkpoint.path").rstrip("/")):
            _set(spec, "model.mountPath", mount := "/models")
        where = parse_model_path(_eff(spec, "model.path"))
        if where.kind != "dir" or not where.location.startswith(mount + "/"):
            _set(spec, "model.path", f"{mount}/model")
    if _eff(spec, "inference.engine") == "native":
        _set(spec, "inference.tensorParallel", 1)
    elif _eff(spec, "inference.tensorParallel") != 1:
        where = parse_model_path(_eff(spec, "model.path"))  # a built-in model's heads must split among the workers
        if where.kind == "builtin" and tensor_parallel_heads_error(*BUILTIN_ATTENTION_HEADS[where.location],
                                                                   _eff(spec, "inference.tensorParallel")):
            _set(spec, "inference.tensorParallel", 1)
    # Colocated: one native engine beside one torch trainer process (validation.colocated_errors).
    if _eff(spec, "inference.placement") == "colocated" and (
            _eff(spec, "inference.engine") != "native" or _eff(spec, "inference.replicas") != 1
            or backend != "torch" or ranks != 1):
        _drop(spec, "inference.placement")
    for role in (*ROLES, "sandbox"):
        requests = _get(spec, f"{role}.resources.requests") or {}
        limits = _get(spec, f"{role}.resources.limits") or {}
        for name in set(requests) & set(limits):
            limits[name] = requests[name]  # a request may not exceed its limit: make them equal
    return spec


SCHEMA_VALID = _value("", SPEC_SCHEMA)


@st.composite
def valid_spec(draw, redis_url: str) -> dict:
    raw = draw(SCHEMA_VALID)
    return make_valid(raw, redis_url, external=draw(st.booleans()))


# -- mutations the API server must refuse -------------------------------------------------------------------

WRONG_TYPES = {
    "integer": st.sampled_from(["ten", 1.5, True, [1], {"a": 1}]),
    "number": st.sampled_from(["x", True, [0.5], {"a": 1}]),
    "string": st.sampled_from([5, True, ["a"], {"a": "b"}, 1.5]),
    "boolean": st.sampled_from(["yes", 1, [True], {"a": True}]),
    "object": st.sampled_from(["x", 5, [{}], True]),
}
REQUIRED = ["model", "algorithm", "model.path", "algorithm.maxSteps", "redis.passwordSecret.name"]


@st.composite
def schema_mutation(draw, spec: dict) -> tuple[str, str]:
    """Apply one mutation the OpenAPI schema rejects; return (path under spec, description)."""
    kind = draw(st.sampled_from(["type", "range", "enum", "required", "pattern", "empty"]))
    if kind == "type":
        path, node = draw(st.sampled_from([(p, n) for p, n in SCALARS + OBJECTS if n.get("type") in WRONG_TYPES]))
        value = draw(WRONG_TYPES[node["type"]])
        _set(spec, path, value)
        return path, f"{path}={value!r} (wrong type)"
    if kind == "range":
        path, node = draw(st.sampled_from([(p, n) for p, n in SCALARS if "minimum" in n or "maximum" in n]))
        below = "minimum" in node and ("maximum" not in node or draw(st.booleans()))
        if below:
            value = node["minimum"] if node.get("exclusiveMinimum") else node["minimum"] - draw(st.sampled_from([1, 7]))
            if node["type"] == "number" and not node.get("exclusiveMinimum"):
                value = node["minimum"] - 0.5
        else:
            value = node["maximum"] + 1
        _set(spec, path, value)
        return path, f"{path}={value!r} (out of range)"
    if kind == "enum":
        path, node = draw(st.sampled_from([(p, n) for p, n in SCALARS if "enum" in n]))
        value = draw(st.sampled_from(["nope", node["enum"][0].upper(), node["enum"][0] + " ", ""]))
        _set(spec, path, value)
        return path, f"{path}={value!r} (unknown enum value)"
    if kind == "required":
        path = draw(st.sampled_from(REQUIRED))
        if path == "redis.passwordSecret.name":
            _set(spec, "redis.passwordSecret", {"key": "k"})
        else:
            _drop(spec, path)
        return path, f"{path} missing"
    if kind == "pattern":
        path = draw(st.sampled_from(["task.entryPoint", "redis.url"]))
        value = draw(st.sampled_from(["not a module", "pkg.mod", ":f", "http://x", "redis:/x", "1pkg:f"]))
        _set(spec, path, value)
        return path, f"{path}={value!r} (pattern)"
    path = draw(st.sampled_from([p for p, n in SCALARS if n.get("minLength")]))
    _set(spec, path, "")
    return path, f"{path}='' (minLength)"


# -- mutations only the operator can refuse -----------------------------------------------------------------


@st.composite
def operator_mutation(draw, spec: dict, redis_url: str) -> tuple[str, str]:
    """Apply one schema-valid mutation that cannot run; return (the field the operator must name, description)."""
    kind = draw(st.sampled_from(["model-path", "no-url", "managed-url", "fast-llm-external", "fast-llm-cpu",
                                 "group", "samples", "clip", "tensor-parallel", "quantity",
                                 "negative", "resource-name", "request-over-limit", "params"]))
    role = draw(st.sampled_from(ROLES))
    if kind == "model-path":
        _set(spec, "model.path", draw(st.sampled_from(["builtin://tiny-gpt", "hf://no-org", "s3://bucket/m"])))
        return "spec.model.path", "a model path of no known form"
    if kind == "no-url":
        _set(spec, "redis.mode", "external")
        _drop(spec, "redis.url")
        _set(spec, "trainer.backend", "torch")
        return "spec.redis.url", "external Redis without url"
    if kind == "managed-url":
        _set(spec, "redis.mode", "managed")
        _set(spec, "redis.url", redis_url)
        return "spec.redis.url", "managed Redis with a url"
    if kind == "fast-llm-external":
        _set(spec, "trainer.backend", "fast-llm")
        _set(spec, "trainer.gpusPerNode", 1)
        _set(spec, "redis.mode", "external")
        _set(spec, "redis.url", redis_url)
        return "spec.redis.mode", "fast-llm with an external Redis"
    if kind == "fast-llm-cpu":
        _set(spec, "trainer.backend", "fast-llm")
        _set(spec, "trainer.gpusPerNode", 0)
        _set(spec, "redis.mode", "managed")
        _drop(spec, "redis.url")
        return "spec.trainer.gpusPerNode", "fast-llm without GPUs"
    if kind == "group":
        _set(spec, "algorithm.loss", draw(st.sampled_from(["grpo", "gspo", "ppo", "reinforce"])))
        _set(spec, "algorithm.groupSize", 1)
        return "spec.algorithm.groupSize", "groups of one"
    if kind == "samples":
        _set(spec, "trainer.nodes", 2)
        _drop(spec, "trainer.megatron.tensorParallel")  # megatron TP 2 on 2 ranks needs one sample (one replica)
        _set(spec, "algorithm.samplesPerStep", 1)
        return "spec.algorithm.samplesPerStep", "fewer samples per step than trainer nodes"
    if kind == "clip":
        value = draw(st.sampled_from([1, 1.5, 100]))
        _set(spec, "algorithm.clipEpsilonLow", value)
        return "spec.algorithm.clipEpsilonLow", f"clipEpsilonLow={value}"
    if kind == "tensor-parallel":
        _set(spec, "inference.engine", "native")
        _set(spec, "inference.tensorParallel", 2)
        return "spec.inference.tensorParallel", "native engine with tensor parallelism"
    kind_of = draw(st.sampled_from(["requests", "limits"]))
    if kind == "quantity":
        value = draw(st.sampled_from(["lots", "1.2.3", "5 Gi", "0x10", "1Gb", "--1"]))
        _set(spec, f"{role}.resources.{kind_of}", {"cpu": value})
        return f"spec.{role}.resources.{kind_of}.cpu", f"{role} cpu {value!r}"
    if kind == "negative":
        _set(spec, f"{role}.resources.{kind_of}", {"memory": draw(st.sampled_from([-1, "-1Gi", "-500m"]))})
        return f"spec.{role}.resources.{kind_of}.memory", f"{role} negative memory"
    if kind == "resource-name":
        name = draw(st.sampled_from(["gpu", "cpus", "Memory", "storage"]))
        _set(spec, f"{role}.resources.{kind_of}", {name: 1})
        return f"spec.{role}.resources.{kind_of}.{name}", f"{role} resource {name!r}"
    if kind == "request-over-limit":
        _set(spec, f"{role}.resources", {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}})
        return f"spec.{role}.resources.requests.cpu", f"{role} request over limit"
    value = draw(st.sampled_from([[1, 2], {"a": 1}, [], {"nested": {"x": "y"}}]))  # (null is pruned: not here)
    _set(spec, "task.params", {"bad": value})
    return "spec.task.params.bad", f"task param of type {type(value).__name__}"


# -- values both validators let through that a Pod or Service may refuse ---------------------------------


@st.composite
def edge_mutation(draw, spec: dict, redis_url: str) -> tuple[str | None, str, str | None]:
    """Apply one edge mutation; return (a job name of its own or None, description, the field the operator must
    refuse it by, or None where running it is as right as refusing it)."""
    kind = draw(st.sampled_from(["image-space", "mount-path", "secret-key", "secret-name", "extended-fraction",
                                 "extended-no-limit", "hugepages", "long-name", "dotted-name", "digit-name",
                                 "claim-name", "checkpoint-relative"]))
    role = draw(st.sampled_from(ROLES))
    if kind == "image-space":
        value = draw(st.sampled_from([" ghcr.io/x:1", "ghcr.io/x:1 ", "ghcr.io/x:1\n", "a b"]))
        where = f"{role}.image" if draw(st.booleans()) else "image"
        _set(spec, where, value)
        return None, f"{where} {value!r}", f"spec.{where}"
    if kind == "mount-path":
        _set(spec, "trainer.checkpoint.path", draw(st.sampled_from(["/etc/rlkube", "/etc/rlkube/", "relative/dir"])))
        return None, f"checkpoint path {_get(spec, 'trainer.checkpoint.path')!r}", "spec.trainer.checkpoint.path"
    if kind in ("secret-key", "secret-name"):
        spec["redis"] = {"mode": "external", "url": redis_url, "passwordSecret": {"name": "pw", "key": "password"}}
        _set(spec, "trainer.backend", "torch")
        if kind == "secret-key":
            spec["redis"]["passwordSecret"]["key"] = draw(st.sampled_from(["bad key", "a/b", "..", "k$"]))
        else:
            spec["redis"]["passwordSecret"]["name"] = draw(st.sampled_from(["Bad_Name", "a b", "-x", "x" * 300]))
        return None, f"password secret {spec['redis']['passwordSecret']}", f"spec.redis.passwordSecret.{kind[7:]}"
    if kind == "extended-fraction":
        _set(spec, f"{role}.resources", {"requests": {"example.com/dev": "0.5"}, "limits": {"example.com/dev": "0.5"}})
        return None, f"{role} extended resource 0.5", f"spec.{role}.resources.requests.example.com/dev"
    if kind == "extended-no-limit":
        _set(spec, f"{role}.resources", {"requests": {"example.com/dev": 1}})
        return None, f"{role} extended resource request without a limit", f"spec.{role}.resources.requests.example.com/dev"
    if kind == "hugepages":
        _set(spec, f"{role}.resources", {"limits": {"hugepages-2Mi": "4Mi"}, "requests": {"hugepages-2Mi": "4Mi"}})
        return None, f"{role} hugepages without cpu or memory", f"spec.{role}.resources"
    if kind == "claim-name":
        _set(spec, "trainer.checkpoint.claimName", draw(st.sampled_from(["Bad Claim", "x" * 300, "a_b"])))
        return None, f"claimName {_get(spec, 'trainer.checkpoint.claimName')!r}", None
    if kind == "checkpoint-relative":
        _set(spec, "trainer.checkpoint.path", "checkpoints")
        return None, "relative checkpoint path", "spec.trainer.checkpoint.path"
    if kind == "long-name":
        n = draw(st.sampled_from([45, 52, 53, 60, 63]))
        return "l" * n, f"job name of {n} characters", "metadata.name" if n > 51 else None
    if kind == "dotted-name":
        return draw(st.sampled_from(["a.b", "job.v1"])), "dotted job name", "metadata.name"
    return draw(st.sampled_from(["1job", "9"])), "job name starting with a digit", "metadata.name"


# -- a case -----------------------------------------------------------------------------------------------------


def _disjoint(paths: list[str], path: str) -> bool:
    return all(not (p == path or p.startswith(path + ".") or path.startswith(p + ".")) for p in paths)


@st.composite
def case(draw, redis_url: str) -> Case:
    spec = draw(valid_spec(redis_url))
    kind = draw(st.sampled_from(["valid", "valid", "schema", "schema", "operator", "operator", "edge"]))
    if kind == "valid":
        if draw(st.booleans()):
            spec["notAField"] = {"x": 1}
            _set(spec, "algorithm.typoSteps", 3)
            return Case(spec, "valid", what=["unknown fields (pruned)"])
        return Case(spec, "valid")
    if kind == "schema":
        paths: list[str] = []
        what: list[str] = []
        for _ in range(draw(st.integers(1, 3))):
            trial = copy.deepcopy(spec)
            path, desc = draw(schema_mutation(trial))
            if _disjoint(paths, path):
                spec = trial
                paths.append(path)
                what.append(desc)
        return Case(spec, "schema", [f"spec.{p}" for p in paths], what)
    if kind == "operator":
        fld, desc = draw(operator_mutation(spec, redis_url))
        return Case(spec, "operator", [fld], [desc])
    name, desc, refused_by = draw(edge_mutation(spec, redis_url))
    return Case(spec, "edge", [refused_by] if refused_by else [], [desc], name=name)


FIELD_IN_MESSAGE = re.compile(r"(?:spec|metadata)\.[A-Za-z0-9_.\[\]-]+")
