"""Checks the CRD schema cannot express, and parsing of whole manifests with field-path errors.

The API server rejects what the OpenAPI schema can express (types, enums, minimums, required fields).
What needs two fields at once is checked here; the operator reports these errors in status and Events
and creates nothing, and `rlkube local` prints them and exits.

In lifecycle, not in rlkube.api (types only): the operator, `rlkube local`, `rlkube validate` and every role
(RoleContext.from_env) run it. The pod-level checks (quantities, images, mounts, templates) are in
rlkube.lifecycle.pod_checks; this module runs them with the rest.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from rlkube.api.model_path import BUILTIN_ATTENTION_HEADS, parse_model_path
from rlkube.api.role import Backend, Role
from rlkube.api.spec import API_VERSION, KIND, TrainingJobSpec
from rlkube.api.task import TaskSpec
from rlkube.contract.parallel import tensor_parallel_heads_error, trainer_world_size
from rlkube.lifecycle.field_errors import FieldError, SpecError
from rlkube.lifecycle.image_reference import PUBLISHED
from rlkube.lifecycle.pod_checks import parse_quantity, pod_field_errors, resource_errors, template_errors

__all__ = [  # the checks of rlkube.lifecycle.pod_checks are run (and re-exported) here with the others
    "FieldError", "SpecError", "parse_quantity", "pod_field_errors", "resource_errors",
    "template_errors", "model_errors", "rank_errors", "semantic_errors", "parse_spec", "parse_manifest",
]


def _pydantic_errors(exc: ValidationError, prefix: str) -> list[FieldError]:
    out = []
    for err in exc.errors():
        loc = [prefix, *(str(p) for p in err["loc"])]
        if err["type"] == "operator_owned":  # spec.PodTemplate refusing a field the operator sets: name the field
            field, where = err["ctx"]["field"], err["ctx"]["where"]
            out.append(FieldError(".".join([*loc, field]), f"set by the operator ({where})"))
            continue
        out.append(FieldError(".".join(loc), err["msg"]))
    return out


def model_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """`spec.model.path` against `claimName`: a model on a claim is a directory below the claim's mountPath."""
    model = spec.model
    try:
        where = parse_model_path(model.path)
    except ValueError as exc:
        return [FieldError("spec.model.path", str(exc).removeprefix("spec.model.path: "))]
    if not model.claim_name:
        return []
    if where.kind != "dir":
        return [FieldError("spec.model.claimName", f"set, but spec.model.path {model.path!r} is not a directory: "
                                                   "a claim holds a model directory (hf:// and builtin:// models go "
                                                   "to the model cache, see spec.model.cacheClaimName)")]
    path, mount = PurePosixPath(where.location), PurePosixPath(model.mount_path)
    if not path.is_absolute() or not path.is_relative_to(mount):
        return [FieldError("spec.model.path", f"{model.path!r} must lie below mountPath {model.mount_path} where "
                                              f"claimName {model.claim_name!r} is mounted")]
    return []


def rank_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """trainer.processesPerNode against the GPUs and the backend. (A GPU count the operator derives replaces one
    written in resources: builders._resources.)"""
    errs = []
    trainer = spec.trainer
    if trainer.processes_per_node is not None:
        where = "spec.trainer.processesPerNode"
        if trainer.backend == Backend.FAST_LLM:
            errs.append(FieldError(where, "fast-llm starts its own processes (one per GPU); leave it unset"))
        elif trainer.gpus_per_node and trainer.processes_per_node != trainer.gpus_per_node:
            errs.append(FieldError(where, f"must equal gpusPerNode ({trainer.gpus_per_node}): one rank per GPU"))
    tp = trainer.megatron.tensor_parallel
    if tp > 1:
        ranks = trainer_world_size(spec)
        if trainer.backend != "megatron":
            errs.append(FieldError("spec.trainer.megatron.tensorParallel", f"{tp} is for backend megatron, not "
                                                                           f"{trainer.backend!r}"))
        elif ranks % tp:
            errs.append(FieldError("spec.trainer.megatron.tensorParallel", f"{tp} does not divide the trainer's "
                                   f"{ranks} ranks (nodes x processes per node): data parallel = ranks / "
                                   "tensorParallel"))
    if trainer.cpu_offload and trainer.sharding != "fsdp":
        errs.append(FieldError("spec.trainer.cpuOffload", "offloads FSDP2's shards: it needs sharding 'fsdp'"))
    if trainer.sharding != "none" and trainer.backend != "torch":
        errs.append(FieldError("spec.trainer.sharding", f"'{trainer.sharding}' shards the torch backend; backend "
                                                        f"{trainer.backend!r} has its own parallelism"))
    elif trainer.sharding == "fsdp":
        if trainer_world_size(spec) < 2:
            errs.append(FieldError("spec.trainer.sharding", "'fsdp' shards over the trainer's ranks: it needs "
                                                            "nodes x processes per node > 1"))
        if trainer.nodes > 1 and not trainer.checkpoint.claim_name:
            # Every rank writes its shards of each checkpoint and reads them back on resume (any world size).
            errs.append(FieldError("spec.trainer.checkpoint.claimName", "sharding 'fsdp' on several nodes writes "
                                                                        "each checkpoint from every node: a shared "
                                                                        "(ReadWriteMany) claim is required"))
    return errs


REASONING_GYM_RESERVED = ("seed", "size")
"""reasoning-gym config fields rlkube sets itself (each pass's seed and size, rlkube.core.actor.gym_tasks)."""


def prompt_source_errors(task: TaskSpec) -> list[FieldError]:
    """A built-in environment with another prompt source: one of the two would be ignored without a word. (dataset,
    reasoningGym and entryPoint against each other: task_errors, by pairs.)"""
    sources = task.prompt_sources()
    if not sources or sources[0] != "spec.task.environment.name" or len(sources) == 1:
        return []
    name = task.environment.name if task.environment is not None else None
    return [FieldError(other, f"not with spec.task.environment.name {name!r}, which draws its own prompts: set "
                              f"one prompt source, {other} or spec.task.environment.name (an environment that "
                              f"takes the task's prompts is an entryPoint of yours)")
            for other in sources[1:]]


def _entry_point_error(field: str, entry_point: str) -> FieldError | None:
    """`package.module:attribute` that this interpreter cannot find: the module (or a package above it) is missing,
    or has no such attribute. A module that is found but fails to import (a dependency this install lacks) is left to
    the role, which imports it at start and exits 78 naming the field."""
    module_name, _, attr = entry_point.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            return FieldError(field, f"cannot import {module_name!r}: no module {exc.name!r} here")
        return None
    except Exception:  # noqa: BLE001 - the module's own code: the role reports it where it runs
        return None
    if not hasattr(module, attr):
        return FieldError(field, f"module {module_name!r} has no attribute {attr!r}")
    return None


def importable_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """spec.task.environment.entryPoint imported in this interpreter. Only where the roles run this interpreter's
    packages: `rlkube local` (it is their interpreter), and `rlkube validate` of a job on the project's own images
    (which hold rlkube and its dependencies, nothing of the user's; published_images). The operator and the webhook
    do not know what a user's image holds: there the actor imports it at start and exits 78 naming the field."""
    env = spec.task.environment
    if env is None or not env.entry_point:
        return []
    err = _entry_point_error("spec.task.environment.entryPoint", env.entry_point)
    return [err] if err is not None else []


def published_images(spec: TrainingJobSpec) -> bool:
    """The actors run one of the project's published images (lifecycle/image_reference.PUBLISHED)."""
    return spec.image_for(Role.ACTOR).startswith(PUBLISHED)


def _regex_error(field: str, pattern: str | None) -> FieldError | None:
    if pattern is None:
        return None
    try:
        re.compile(pattern)
    except re.error as exc:
        return FieldError(field, f"not a regular expression: {exc}")
    return None


def task_errors(task: TaskSpec, loss: str = "grpo") -> list[FieldError]:
    """The task's cross-field rules: one prompt source, a dataset needs a reward (unless `loss` is sft, which reads
    reference completions and scores none: sft_errors says what it needs instead), each reward type its own
    fields."""
    errs: list[FieldError] = prompt_source_errors(task)
    ds, reward = task.dataset, task.reward
    if ds is not None:
        if task.entry_point:
            errs.append(FieldError("spec.task.entryPoint", "must be empty when spec.task.dataset is set"))
        if task.params:
            errs.append(FieldError("spec.task.params", "not used with spec.task.dataset (dataset tasks take none)"))
        if reward is None and ds.completion_field is None and loss != "sft":
            errs.append(FieldError("spec.task.reward", "required with spec.task.dataset (math, exact, regex or python)"))
        if ds.prompt_field and ds.messages_field:
            errs.append(FieldError("spec.task.dataset.messagesField", "set promptField or messagesField, not both"))
        if ds.claim_name and PurePosixPath(ds.path).is_absolute() and not PurePosixPath(ds.path).is_relative_to(
            ds.mount_path
        ):
            errs.append(FieldError("spec.task.dataset.path", f"must lie below mountPath {ds.mount_path} where "
                                   f"claimName {ds.claim_name!r} is mounted"))
    if task.reasoning_gym is not None:
        for field, clash in (("spec.task.dataset", ds is not None), ("spec.task.entryPoint", bool(task.entry_point)),
                             ("spec.task.params", bool(task.params))):
            if clash:
                errs.append(FieldError(field, "not with spec.task.reasoningGym (its prompts come from the "
                                       "reasoning-gym task; its settings go in reasoningGym.config)"))
        for key in REASONING_GYM_RESERVED:
            if key in task.reasoning_gym.config:
                errs.append(FieldError(f"spec.task.reasoningGym.config.{key}", f"reserved: rlkube sets the "
                                       f"generator's {key} from spec.task.reasoningGym.{key} (set that instead)"))
    if reward is not None:
        if reward.type == "python" and not reward.function:
            errs.append(FieldError("spec.task.reward.function", "required when spec.task.reward.type is python"))
        if reward.type != "python" and reward.function:
            errs.append(FieldError("spec.task.reward.function", "only used when spec.task.reward.type is python"))
        if reward.type != "python" and reward.params:
            errs.append(FieldError("spec.task.reward.params", "only used when spec.task.reward.type is python"))
        if reward.type == "regex" and not reward.pattern:
            errs.append(FieldError("spec.task.reward.pattern", "required when spec.task.reward.type is regex"))
        if reward.type != "regex" and reward.pattern:
            errs.append(FieldError("spec.task.reward.pattern", "only used when spec.task.reward.type is regex "
                                   "(answerPattern extracts answers for math and exact)"))
        if reward.answer_pattern and reward.type not in ("math", "exact"):
            errs.append(FieldError("spec.task.reward.answerPattern", "only used by the math and exact rewards"))
        if err := _regex_error("spec.task.reward.pattern", reward.pattern):
            errs.append(err)
        if err := _regex_error("spec.task.reward.answerPattern", reward.answer_pattern):
            errs.append(err)
        elif reward.answer_pattern and re.compile(reward.answer_pattern).groups == 0:
            errs.append(FieldError("spec.task.reward.answerPattern", "needs a group (named `answer`, or the first) "
                                   "around the answer"))
    return errs


FAST_LLM_LOSSES = ("grpo", "gspo")
"""The policy-gradient losses Fast-LLM implements (its loss types `grpo` and `gspo`)."""


def fast_llm_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """What a `trainer.backend: fast-llm` job needs that Fast-LLM itself would only find out in the pod."""
    errs: list[FieldError] = []
    if spec.redis.mode != "managed":
        errs.append(FieldError("spec.redis.mode", "fast-llm uses fixed stream names and needs its own (managed) Redis"))
    if spec.trainer.gpus_per_node < 1:
        errs.append(FieldError("spec.trainer.gpusPerNode", "fast-llm runs on GPUs only; set at least 1"))
    if spec.trainer.fast_llm.model_format is None:
        errs.append(FieldError("spec.trainer.fastLlm.modelFormat",
                               "required with backend fast-llm: the model_type of the checkpoint's config.json"))
    fast = spec.trainer.fast_llm
    if fast.broadcast_timeout_seconds <= fast.data_timeout_seconds:
        # The servers wait in the broadcast while the trainer waits for documents: they would time out first.
        errs.append(FieldError("spec.trainer.fastLlm.broadcastTimeoutSeconds",
                               f"must exceed dataTimeoutSeconds ({fast.data_timeout_seconds:g}): the inference "
                               "servers wait in the broadcast through the trainer's whole wait for documents"))
    if spec.model.path.startswith("builtin://"):
        errs.append(FieldError("spec.model.path", "fast-llm imports a Hugging Face checkpoint directory; "
                                                  "built-in models exist only in rlkube's own trainers"))
    if spec.model.path.startswith("hf://"):
        # rlkube.controller.manifests.fastllm hands spec.model.path to Fast-LLM as `pretrained.path`, a directory;
        # nothing materializes an hf:// model into the trainer pod for it (the other roles fetch it themselves).
        errs.append(FieldError("spec.model.path", "fast-llm imports a checkpoint directory and cannot fetch an "
                                                  "hf:// model; give a path on a volume (model.claimName)"))
    if spec.algorithm.loss not in FAST_LLM_LOSSES:
        errs.append(FieldError("spec.algorithm.loss", f"fast-llm implements {' and '.join(FAST_LLM_LOSSES)}, "
                                                      f"not {spec.algorithm.loss}"))
    if spec.trainer.nodes > 1 and not spec.trainer.checkpoint.claim_name:
        # Fast-LLM's rank 0 creates each checkpoint directory and every rank writes its shard into it.
        errs.append(FieldError("spec.trainer.checkpoint.claimName", "fast-llm on several nodes writes one "
                                                                    "checkpoint from every node: a shared "
                                                                    "(ReadWriteMany) claim is required"))
    if spec.tracking.any:
        errs.append(FieldError("spec.tracking", "fast-llm trains in its own trainer, which does not log to "
                                                "rlkube's trackers (set them in Fast-LLM's config instead)"))
    return errs


def semantic_errors(spec: TrainingJobSpec) -> list[FieldError]:
    errs: list[FieldError] = resource_errors(spec) + pod_field_errors(spec) + rank_errors(spec) + template_errors(spec)
    errs += task_errors(spec.task, spec.algorithm.loss) + model_errors(spec)
    if spec.redis.mode == "external" and not spec.redis.url:
        errs.append(FieldError("spec.redis.url", "required when spec.redis.mode is external"))
    if spec.redis.mode == "managed" and spec.redis.url:
        errs.append(FieldError("spec.redis.url", "must be empty when spec.redis.mode is managed"))
    if spec.trainer.backend == Backend.FAST_LLM:
        errs += fast_llm_errors(spec)
    errs += loss_extension_errors(spec) + sft_errors(spec) + lora_errors(spec) + environment_errors(spec)
    errs += evaluation_errors(spec) + sandbox_errors(spec) + colocated_errors(spec)
    algo = spec.algorithm
    if algo.loss != "sft" and algo.group_size < 2:
        errs.append(FieldError("spec.algorithm.groupSize", f"{algo.loss} needs groups of at least 2 samples"))
    ranks = trainer_world_size(spec)
    tp = spec.trainer.megatron.tensor_parallel
    if spec.trainer.backend == "megatron" and tp > 1 and ranks % tp == 0:
        # Each data-parallel replica (tensorParallel ranks) trains its share of every step.
        if algo.samples_per_step < ranks // tp:
            errs.append(FieldError("spec.algorithm.samplesPerStep", f"must be at least the trainer's data-parallel "
                                   f"ranks ({ranks // tp} = nodes x processes per node / tensorParallel): every "
                                   "replica trains a share of each step"))
    elif algo.samples_per_step < ranks:
        # Each trainer rank trains its share of every step (samplesPerStep split as evenly as possible).
        errs.append(FieldError("spec.algorithm.samplesPerStep", f"must be at least the trainer's ranks "
                               f"({ranks} = nodes x processes per node): every rank trains a share of each step"))
    if algo.clip_epsilon_low >= 1:
        errs.append(FieldError("spec.algorithm.clipEpsilonLow", "must be below 1 (the ratio is clipped at 1-eps)"))
    if spec.inference.engine == "native" and spec.inference.tensor_parallel != 1:
        errs.append(FieldError("spec.inference.tensorParallel", "the native engine has no tensor parallelism"))
    elif spec.inference.tensor_parallel != 1:
        with contextlib.suppress(ValueError):  # a malformed path is reported on its own field
            path = parse_model_path(spec.model.path)
            if path.kind == "builtin" and (problem := tensor_parallel_heads_error(
                    *BUILTIN_ATTENTION_HEADS[path.location], spec.inference.tensor_parallel)):
                errs.append(FieldError("spec.inference.tensorParallel", f"{spec.model.path}: {problem}"))
    if algo.warmup_steps >= algo.max_steps and algo.lr_schedule != "constant":
        errs.append(FieldError("spec.algorithm.warmupSteps", f"must be below maxSteps ({algo.max_steps}) for the "
                               f"{algo.lr_schedule} schedule to decay after it"))
    return errs


SANDBOX_LIMITS = ("cpu", "memory", "ephemeral-storage")
"""Limits every sandbox pod must have: a snippet spins, allocates and writes within them (docs/guide/sandbox.md)."""


def sandbox_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """spec.sandbox with mode `pods`: something to call them (an environment), and the pod limits a snippet runs in."""
    pool = spec.sandbox
    if pool.mode != "pods":
        return []
    errs = []
    if spec.task.environment is None:
        errs.append(FieldError("spec.sandbox.mode", "`pods` runs the snippets of spec.task.environment's tools; this "
                               "job has no environment"))
    missing = [name for name in SANDBOX_LIMITS if name not in pool.resources.limits]
    if missing:
        errs.append(FieldError("spec.sandbox.resources.limits", f"sandbox pods need limits on {', '.join(missing)} "
                               f"(all of: {', '.join(SANDBOX_LIMITS)})"))
    return errs


def evaluation_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """spec.evaluation: a split is one of spec.task.dataset's (held out by the split, not by a hash); evaluation
    scores samples, so it needs a reward (sft reads a dataset that may have none)."""
    ev = spec.evaluation
    if ev is None:
        return []
    errs: list[FieldError] = []
    if ev.split is not None and spec.task.dataset is None:
        errs.append(FieldError("spec.evaluation.split", "needs spec.task.dataset (a split of the training dataset; "
                               "without one, prompts are held out by spec.evaluation.heldOutFraction)"))
    if ev.split is not None and ev.held_out_fraction is not None:
        errs.append(FieldError("spec.evaluation.heldOutFraction", "not with spec.evaluation.split: the split holds "
                               "the eval prompts out"))
    if spec.task.reward is None and spec.task.dataset is not None:
        errs.append(FieldError("spec.evaluation", "needs spec.task.reward: this dataset task (loss sft) scores no "
                               "sample"))
    return errs


def environment_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """spec.task.environment (multi-turn episodes, rlkube.core.actor.episodes): one source, built-in name or entryPoint;
    sampled episodes, so not with sft; and an episode budget the trainer can take whole (the preprocessor drops
    documents over maxSequenceLength, so a larger budget would only waste episodes)."""
    env = spec.task.environment
    if env is None:
        return []
    errs: list[FieldError] = []
    if (env.name is None) == (env.entry_point is None):
        errs.append(FieldError("spec.task.environment.name", "set exactly one of name (a built-in environment: "
                               "calculator, verifiers) and entryPoint"))
    if spec.algorithm.loss == "sft":
        errs.append(FieldError("spec.task.environment", "not with spec.algorithm.loss sft (episodes are sampled from "
                               "the policy; sft reads reference completions)"))
    limit = spec.model.max_sequence_length
    if env.max_episode_tokens is not None and limit is not None and env.max_episode_tokens > limit:
        errs.append(FieldError("spec.task.environment.maxEpisodeTokens", f"{env.max_episode_tokens} is over "
                               f"spec.model.maxSequenceLength ({limit}): longer episodes could not be trained on"))
    return errs


def sft_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """loss sft trains on a dataset's reference completions (rlkube.core.actor reads them instead of sampling):
    it needs task.dataset.completionField, and a completion field is refused with any other loss (an RL loss
    would silently never read it)."""
    ds, loss = spec.task.dataset, spec.algorithm.loss
    field = "spec.task.dataset.completionField"
    if loss == "sft" and (ds is None or ds.completion_field is None):
        where = "" if ds is not None else " (with spec.task.dataset: sft learns from reference completions, not from " \
                                          "the policy's own samples)"
        return [FieldError(field, f"required with spec.algorithm.loss sft: the column holding each prompt's reference "
                                  f"completion{where}")]
    if loss != "sft" and ds is not None and ds.completion_field is not None:
        return [FieldError(field, f"only used with spec.algorithm.loss sft, not {loss} (which samples completions "
                                  "from the policy); remove it or set loss sft")]
    return []


def loss_extension_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """The reference KL needs a frozen reference model, which only the torch backend (unsharded) loads; Fast-LLM
    computes its own loss, so neither the KL nor the off-policy correction reaches it (rlkube.core.training.losses)."""
    errs: list[FieldError] = []
    algo, trainer = spec.algorithm, spec.trainer
    if algo.kl_coef > 0 and (trainer.backend != "torch" or trainer.sharding == "fsdp"):
        what = "sharding fsdp" if trainer.backend == "torch" else f"backend {trainer.backend}"
        errs.append(FieldError("spec.algorithm.klCoef", f"a KL to the reference policy is implemented for the torch "
                               f"backend without FSDP, not {what}; set klCoef to 0"))
    if algo.off_policy_correction.mode != "none" and trainer.backend == Backend.FAST_LLM:
        errs.append(FieldError("spec.algorithm.offPolicyCorrection.mode", "fast-llm computes its own loss; "
                               "off-policy correction is for backends torch and megatron (use mode none)"))
    return errs


def colocated_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """spec.inference.placement `colocated` (docs/guide/colocated.md): one native engine in the one trainer pod,
    beside its one training process. vLLM colocation (sleep mode, a same-device transfer) is not built."""
    if spec.inference.placement != "colocated":
        return []
    field = "spec.inference.placement"
    trainer, inference = spec.trainer, spec.inference
    errs = []
    if inference.engine != "native":
        errs.append(FieldError(field, f"colocated runs the native engine in the trainer's pod; engine "
                                      f"{inference.engine} is not colocated (use placement separate)"))
    if inference.replicas != 1:
        errs.append(FieldError(field, f"colocated runs one engine beside the trainer; spec.inference.replicas is "
                                      f"{inference.replicas}"))
    if trainer.backend != "torch":
        errs.append(FieldError(field, f"colocated is built for backend torch, not {trainer.backend}"))
    if trainer_world_size(spec) != 1:
        errs.append(FieldError(field, "colocated needs one trainer process (spec.trainer.nodes and "
                                      "processesPerNode 1)"))
    return errs


def lora_errors(spec: TrainingJobSpec) -> list[FieldError]:
    """LoRA (spec.trainer.lora) is built on the torch backend with PEFT (rlkube.core.training.lora), unsharded or with
    sharding fsdp (rlkube.core.backends.fsdp_lora)."""
    trainer = spec.trainer
    if trainer.lora is None:
        return []
    if trainer.backend != "torch":
        return [FieldError("spec.trainer.lora", f"LoRA adapters are trained by backend torch, not "
                                                f"{trainer.backend}; unset spec.trainer.lora or use backend torch")]
    return []


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
