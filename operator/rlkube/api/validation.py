"""Checks the CRD schema cannot express, and parsing of whole manifests with field-path errors.

The API server rejects what the OpenAPI schema can express (types, enums, minimums, required fields).
What needs two fields at once is checked here; the operator reports these errors in status and Events
and creates nothing, and `rlkube local` prints them and exits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import ValidationError

from rlkube.api.model_path import parse_model_path
from rlkube.api.spec import API_VERSION, KIND, TrainingJobSpec


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """A TrainingJob that cannot run; `errors` name each offending field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def _pydantic_errors(exc: ValidationError, prefix: str) -> list[FieldError]:
    out = []
    for err in exc.errors():
        path = ".".join([prefix, *(str(p) for p in err["loc"])])
        out.append(FieldError(path, err["msg"]))
    return out


_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")


def parse_quantity(value: int | str) -> Decimal:
    """A Kubernetes resource quantity (`500m`, `2Gi`, `1e3`, `4`) by the API server's grammar; ValueError else."""
    if isinstance(value, int):
        return Decimal(value)
    m = _QUANTITY.match(value)
    if m is None:
        raise ValueError(f"{value!r} is not a quantity (e.g. 500m, 2, 1Gi)")
    number, suffix = Decimal(m.group(1)), m.group(2) or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:])) if suffix else number


def resource_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """What the Pod schema checks in a container's resources, so it fails here and not at pod creation."""
    errs: list[FieldError] = []
    for role in ("trainer", "inference", "preprocessor", "actor"):
        res = getattr(spec, role).resources
        parsed: dict[str, dict[str, Decimal]] = {"requests": {}, "limits": {}}
        for kind in ("requests", "limits"):
            for name, value in getattr(res, kind).items():
                where = f"spec.{role}.resources.{kind}.{name}"
                if name not in _CONTAINER_RESOURCES and not name.startswith("hugepages-") and "/" not in name:
                    errs.append(
                        FieldError(where, f"unknown resource {name!r}: cpu, memory, ephemeral-storage, hugepages-*, "
                                          "or a fully qualified extended resource (example.com/gpu)")
                    )
                    continue
                try:
                    quantity = parse_quantity(value)
                except ValueError as exc:
                    errs.append(FieldError(where, str(exc)))
                    continue
                if quantity < 0:
                    errs.append(FieldError(where, "must not be negative"))
                    continue
                parsed[kind][name] = quantity
        for name, request in parsed["requests"].items():
            limit = parsed["limits"].get(name)
            if limit is not None and request > limit:
                errs.append(FieldError(f"spec.{role}.resources.requests.{name}", f"must not exceed the limit {limit}"))
    return errs


def semantic_errors(spec: TrainingJobSpec) -> list[FieldError]:
    errs: list[FieldError] = resource_errors(spec)
    try:
        parse_model_path(spec.model.path)
    except ValueError as exc:
        errs.append(FieldError("spec.model.path", str(exc).removeprefix("spec.model.path: ")))
    if spec.redis.mode == "external" and not spec.redis.url:
        errs.append(FieldError("spec.redis.url", "required when spec.redis.mode is external"))
    if spec.redis.mode == "managed" and spec.redis.url:
        errs.append(FieldError("spec.redis.url", "must be empty when spec.redis.mode is managed"))
    if spec.trainer.backend == "fast-llm":
        if spec.redis.mode != "managed":
            errs.append(
                FieldError("spec.redis.mode", "fast-llm uses fixed stream names and needs its own (managed) Redis")
            )
        if spec.trainer.gpus_per_node < 1:
            errs.append(FieldError("spec.trainer.gpusPerNode", "fast-llm runs on GPUs only; set at least 1"))
    algo = spec.algorithm
    if algo.loss != "sft" and algo.group_size < 2:
        errs.append(FieldError("spec.algorithm.groupSize", f"{algo.loss} needs groups of at least 2 samples"))
    if algo.samples_per_step < spec.trainer.nodes:
        # Each trainer node trains its share of every step (samplesPerStep split as evenly as possible).
        errs.append(FieldError("spec.algorithm.samplesPerStep", f"must be at least spec.trainer.nodes "
                               f"({spec.trainer.nodes}): every trainer node trains a share of each step"))
    if algo.clip_epsilon_low >= 1:
        errs.append(FieldError("spec.algorithm.clipEpsilonLow", "must be below 1 (the ratio is clipped at 1-eps)"))
    if spec.inference.engine == "native" and spec.inference.tensor_parallel != 1:
        errs.append(FieldError("spec.inference.tensorParallel", "the native engine has no tensor parallelism"))
    if algo.warmup_steps >= algo.max_steps and algo.lr_schedule != "constant":
        errs.append(FieldError("spec.algorithm.warmupSteps", f"must be below maxSteps ({algo.max_steps}) for the "
                               f"{algo.lr_schedule} schedule to decay after it"))
    return errs


def parse_spec(spec: dict[str, Any], prefix: str = "spec") -> TrainingJobSpec:
    """Validate a spec dict (camelCase, as in the manifest); raise SpecError naming every bad field."""
    try:
        parsed = TrainingJobSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecError(_pydantic_errors(exc, prefix)) from None
    errs = semantic_errors(parsed)
    if errs:
        raise SpecError(errs)
    return parsed


def parse_manifest(doc: dict[str, Any]) -> tuple[dict[str, Any], TrainingJobSpec]:
    """Return (metadata, spec) of a TrainingJob manifest, or raise SpecError."""
    if not isinstance(doc, dict):
        raise SpecError([FieldError("(document)", "a TrainingJob manifest must be a mapping")])
    errs = []
    if doc.get("apiVersion") != API_VERSION:
        errs.append(FieldError("apiVersion", f"must be {API_VERSION}, got {doc.get('apiVersion')!r}"))
    if doc.get("kind") != KIND:
        errs.append(FieldError("kind", f"must be {KIND}, got {doc.get('kind')!r}"))
    meta = doc.get("metadata") or {}
    if not meta.get("name"):
        errs.append(FieldError("metadata.name", "required"))
    if errs:
        raise SpecError(errs)
    return meta, parse_spec(doc.get("spec") or {})
