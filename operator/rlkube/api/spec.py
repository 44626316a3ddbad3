"""The TrainingJob spec: the single source of truth for the CRD schema, the operator and `rlkube local`.

Pydantic v2 rather than dataclasses: one declaration gives us validation with field paths in the error
(what `rlkube local` and the operator report), camelCase aliases for the Kubernetes side, defaults, and a
JSON schema that `rlkube.api.crd` turns into the CRD's OpenAPI schema, so the two can never disagree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "rlkube.io"
VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ["tj"]
API_VERSION = f"{GROUP}/{VERSION}"

Quantity = int | str


class Model(BaseModel):
    """Base for every spec type: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Resources(Model):
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, as in a container's resources.requests."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, as in a container's resources.limits."
    )


MODEL_PATH_FORMS = "a directory, `hf://org/name[@revision]`, or `builtin://tiny-llama`"


class ModelSpec(Model):
    path: str = Field(
        ...,
        min_length=1,
        description=(
            "The Hugging Face model directory every role loads (config.json, safetensors weights, tokenizer files, "
            "optional chat template): a directory inside the pods (a volume, a PVC, the image), "
            "`hf://org/name[@revision]` (fetched once per job into the model cache), or `builtin://tiny-llama` "
            "(a tiny random Llama with a character tokenizer, written locally from `seed`)."
        ),
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description=(
            "Compute and serving dtype. bfloat16 trains with float32 master weights and optimizer state "
            "(bfloat16 autocast) and serves bfloat16 weights."
        ),
    )
    seed: int = Field(0, ge=0, description="Seed for the built-in model's random weights and for sampling.")
    max_sequence_length: int = Field(
        1024,
        ge=8,
        description=(
            "Most tokens of prompt plus completion. Inference refuses requests whose prompt plus max tokens exceed "
            "it; a longer sample (from an engine with a larger limit) is dropped by the preprocessor and counted."
        ),
    )


class TaskSpec(Model):
    name: str = Field(
        "reverse-digits",
        min_length=1,
        description="A built-in task (see `rlkube tasks`) or, with entryPoint set, a label for the custom task.",
    )
    entry_point: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="Importable `package.module:factory` returning a Task; overrides the built-in name.",
    )
    params: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Task parameters passed to the task factory."
    )


class AlgorithmSpec(Model):
    loss: Literal["grpo", "gspo", "ppo", "reinforce", "sft"] = Field("grpo", description="Policy loss.")
    max_steps: int = Field(..., ge=1, description="Optimizer steps after which training finishes.")
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (one group).")
    samples_per_step: int = Field(32, ge=1, description="Training samples consumed per optimizer step.")
    learning_rate: float = Field(3e-3, gt=0, description="Adam learning rate (the peak, after warm-up).")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="Learning rate after warm-up: constant, or decaying to 0 at maxSteps."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up from 0.")
    clip_epsilon_low: float = Field(0.2, ge=0, description="Lower clip of the importance ratio (1 - eps).")
    clip_epsilon_high: float = Field(0.2, ge=0, description="Upper clip of the importance ratio (1 + eps).")
    max_lag: int = Field(
        2, ge=0, description="Most weight versions a rollout may lag behind the trainer when it is used."
    )
    advantage: Literal["leave-one-out", "mean-std"] = Field(
        "leave-one-out", description="Group-relative advantage estimator."
    )
    normalize_advantage: bool = Field(False, description="Divide advantages by the group's std (+1e-4).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the actors.")
    max_new_tokens: int = Field(8, ge=1, description="Most tokens generated per completion.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")


class CheckpointSpec(Model):
    path: str = Field("/checkpoints", min_length=1, description="Directory for checkpoints inside the trainer.")
    claim_name: str | None = Field(
        None, min_length=1, description="PersistentVolumeClaim mounted at `path`; emptyDir when unset."
    )
    interval_steps: int = Field(10, ge=1, description="Save a checkpoint every this many steps (and at the end).")


class WeightTransferSpec(Model):
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype weights travel in to the inference servers (`auto`: bfloat16 on GPUs, float32 on CPU); "
        "each server converts them to the dtype it serves.",
    )
    bucket_megabytes: int = Field(
        64, ge=1, description="Size of one transfer bucket: several tensors flattened into one collective."
    )


class TrainerSpec(Model):
    backend: Literal["torch", "megatron", "fast-llm"] = Field("torch", description="Training backend.")
    nodes: int = Field(1, ge=1, description="Trainer pods (one per node); ranks get a headless Service.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per trainer pod (0 = CPU).")
    image: str | None = Field(None, min_length=1, description="Image of the trainer pods (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each trainer pod.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Token budget of one forward/backward pass (rows x padded length); a step accumulates as many "
        "micro-batches as its documents need (a longer document gets a micro-batch of its own).",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, about a third more compute)."
    )
    weight_transfer: WeightTransferSpec = Field(
        default_factory=WeightTransferSpec, description="How weights are sent to the inference servers."
    )


class InferenceSpec(Model):
    engine: Literal["vllm", "native"] = Field(
        "vllm", description="`vllm`, or `native` (a small torch server for CPU tiny models)."
    )
    replicas: int = Field(1, ge=1, description="Inference servers; each joins the weight-update group.")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size of each server.")
    image: str | None = Field(None, min_length=1, description="Image (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each server.")


class WorkerSpec(Model):
    replicas: int = Field(1, ge=1, description="Pods of this role.")
    image: str | None = Field(None, min_length=1, description="Image (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each pod.")


class SecretKeyRef(Model):
    name: str = Field(..., min_length=1, description="Secret name.")
    key: str = Field("password", min_length=1, description="Key inside the Secret.")


class RedisSpec(Model):
    mode: Literal["managed", "external"] = Field(
        "managed", description="`managed`: the operator runs one Redis per job; `external`: use `url`."
    )
    url: str | None = Field(
        None, pattern=r"^rediss?://", description="redis:// URL of an external Redis (mode external)."
    )
    password_secret: SecretKeyRef | None = Field(
        None, description="Secret holding the external Redis password (managed mode generates its own)."
    )
    image: str = Field("redis:7-alpine", min_length=1, description="Image of the managed Redis.")


RestartPolicy = Literal["OnFailure", "Never"]


class RestartPolicies(Model):
    trainer: RestartPolicy = Field(
        "OnFailure", description="Recreate a failed trainer (resuming from its checkpoint) while backoffLimit allows."
    )
    inference: RestartPolicy = Field("OnFailure", description="Recreate failed inference servers.")
    actor: RestartPolicy = Field("OnFailure", description="Recreate failed actors in place; the job continues.")
    preprocessor: RestartPolicy = Field("OnFailure", description="Recreate a failed preprocessor.")


class RunPolicy(Model):
    backoff_limit: int = Field(3, ge=0, description="Trainer restarts allowed before the job fails.")
    component_backoff_limit: int = Field(
        6,
        ge=0,
        description=(
            "Restarts allowed for each other component (Redis, inference, preprocessor, actors; counted over the "
            "role's replicas, in place or recreated) before the job fails."
        ),
    )
    restart_policy: RestartPolicies = Field(
        default_factory=RestartPolicies, description="Per-component restart policy."
    )
    completion_timeout_seconds: int = Field(
        120,
        ge=1,
        description="How long one completion signal (trainer exit 0, or training_finished) may wait for the other.",
    )
    event_timeout_seconds: int = Field(
        900, ge=0, description="No trainer event for this long while Running sets Stalled (0 disables)."
    )
    fail_on_stall: bool = Field(False, description="Fail the job when it is Stalled instead of only reporting it.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the TrainingJob this long after it finished (unset: keep)."
    )
    suspend: bool = Field(False, description="Stop all pods (ordered) and keep the job; unset to resume.")


class GracePeriods(Model):
    actor: int = Field(30, ge=0, description="Seconds actors get to stop before they are force-deleted.")
    preprocessor: int = Field(30, ge=0, description="Seconds the preprocessor gets to stop.")
    inference: int = Field(30, ge=0, description="Seconds inference servers get to stop.")
    trainer: int = Field(60, ge=0, description="Seconds trainer pods get to stop.")
    redis: int = Field(30, ge=0, description="Seconds Redis gets to stop.")


class TeardownSpec(Model):
    grace_period_seconds: GracePeriods = Field(
        default_factory=GracePeriods, description="Grace period of each teardown stage, then force delete."
    )
    keep_trainer_pod: bool = Field(
        False, description="Leave finished trainer pods in place so their logs stay readable."
    )


class TrainingJobSpec(Model):
    image: str = Field(
        "ghcr.io/rlkube/core:0.1.0", min_length=1, description="Default image of every role's pods."
    )
    model: ModelSpec = Field(..., description="The model (a Hugging Face directory) every role loads.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Rollout environment and reward.")
    algorithm: AlgorithmSpec = Field(..., description="RL algorithm and its hyper-parameters.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer pods.")
    inference: InferenceSpec = Field(default_factory=InferenceSpec, description="Inference servers.")
    actor: WorkerSpec = Field(default_factory=WorkerSpec, description="Actors (rollout producers).")
    preprocessor: WorkerSpec = Field(default_factory=WorkerSpec, description="Preprocessors.")
    redis: RedisSpec = Field(default_factory=RedisSpec, description="The Redis that connects the roles.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Restarts, timeouts, suspend.")
    teardown: TeardownSpec = Field(default_factory=TeardownSpec, description="Ordered teardown settings.")

    def image_for(self, role: str) -> str:
        if role == "redis":
            return self.redis.image
        own = getattr(self, role).image
        return own or self.image
