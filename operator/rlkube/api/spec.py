"""The TrainingJob spec: the single source of truth for the CRD schema, the operator and `rlkube local`.

Pydantic v2 rather than dataclasses: one declaration gives us validation with field paths in the error
(what `rlkube local` and the operator report), camelCase aliases for the Kubernetes side, defaults, and a
JSON schema that `rlkube.api.crd` turns into the CRD's OpenAPI schema, so the two can never disagree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlkube.api.base import Model, Quantity
from rlkube.api.pod_template import TEMPLATE_DESCRIPTION, PodTemplate
from rlkube.api.role import Role
from rlkube.api.task import TaskSpec
from rlkube.api.tracking import TrackingSpec

GROUP = "rlkube.io"
VERSION = "v1alpha1"
KIND = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ["tj"]
API_VERSION = f"{GROUP}/{VERSION}"
GPU = "nvidia.com/gpu"
"""The extended resource a GPU pod requests (TrainingJobSpec.gpus_per_pod GPUs of it)."""

MAX_SECONDS = 10 * 365 * 24 * 3600
"""Upper bound of every duration field (ten years): the operator adds durations to the current time, and a
datetime cannot go past year 9999 (a generated-input test found 10**14 seconds crashing every reconcile pass)."""


class Resources(Model):
    requests: dict[str, Quantity] = Field(
        default_factory=dict, description="Minimum resources, as in a container's resources.requests."
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict, description="Maximum resources, as in a container's resources.limits."
    )


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
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description=(
            "Compute and serving dtype. bfloat16 trains with float32 master weights and optimizer state "
            "(bfloat16 autocast) and serves bfloat16 weights. float16: Fast-LLM and serving only (the torch "
            "backend has no loss scaling and refuses it)."
        ),
    )
    seed: int = Field(0, ge=0, description="Seed for the built-in model's random weights, for sampling and "
                      "for a fresh LoRA adapter's random lora_A (spec.trainer.lora).")
    max_sequence_length: int = Field(
        1024,
        ge=8,
        description=(
            "Most tokens of prompt plus completion. Inference refuses requests whose prompt plus max tokens exceed "
            "it; a longer sample (from an engine with a larger limit) is dropped by the preprocessor and counted."
        ),
    )
    claim_name: str | None = Field(
        None,
        min_length=1,
        description=(
            "PersistentVolumeClaim holding the model, mounted read-only at mountPath in every pod that loads the "
            "model (trainer, inference, actor); path must then be a directory below mountPath. A claim shared by "
            "several pods (more than one trainer node, replicas, or roles on other nodes) must allow that: "
            "ReadOnlyMany or ReadWriteMany."
        ),
    )
    mount_path: str = Field("/models", pattern=r"^/", description="Where claimName is mounted.")
    cache_claim_name: str | None = Field(
        None,
        min_length=1,
        description=(
            "PersistentVolumeClaim for the model cache (hf:// snapshots, builtin:// models), mounted writable in "
            "every pod that loads the model: the first pod's init container fetches or writes the model and the "
            "others find it there, so a job fetches once (and a later job reusing the claim not at all). Needs "
            "ReadWriteMany when those pods may run on several nodes. Unset: an emptyDir per pod, each pod fetching "
            "its own copy."
        ),
    )


class EvaluationSpec(Model):
    """Evaluation while training: a fixed set of held-out prompts scored every `everyVersions` weight versions with
    fixed sampling settings by actor 0, never trained on (rlkube.core.actor.evaluation)."""

    every_versions: int = Field(
        ..., ge=1, le=1_000_000, description="Score the eval set with weight version 0 and every version that is a "
        "multiple of this, the final one included (scored after training_finished unless the actors are stopped "
        "first)."
    )
    prompts: int = Field(32, ge=1, le=100_000, description="Eval prompts (distinct; fewer when the held-out "
                         "part of a small prompt space has fewer).")
    held_out_fraction: float | None = Field(
        None, gt=0, lt=1, description="Share of the task's prompts held out for evaluation, chosen by a hash of "
        "each prompt, so the split is the same in every actor and every run (unset: 0.1). Training never draws "
        "them. Not with split."
    )
    split: str | None = Field(
        None, min_length=1, description="Evaluate on this split of spec.task.dataset instead (`test`, "
        "`train[-100:]`); the job fails at start if any of its prompts is also in the training split."
    )
    seed: int = Field(0, ge=0, description="Seed of the draw of the eval set from the held-out prompts.")
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of evaluation (0: greedy).")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Most tokens per eval completion (per reply in episodes; unset: "
        "spec.algorithm.maxNewTokens)."
    )


class SamplesSpec(Model):
    """Rollout samples kept for people to read (rlkube.core.trainer.samples): every `everySteps` steps the trainer
    appends `perStep` of the step's samples (prompt, completion with its turns and masked spans, reward, advantage,
    weight version and lag, finish reason) to `samples.jsonl` in its output (the checkpoint volume in a cluster,
    the run directory with `rlkube local`), with the evaluation's samples per evaluated version; `rlkube samples`
    prints them and `rlkube report` browses them."""

    every_steps: int = Field(
        10, ge=0, le=1_000_000, description="Keep samples of every step that is a multiple of this (0: none)."
    )
    per_step: int = Field(4, ge=1, le=1024, description="Samples kept per kept step (and per evaluated version).")
    max_bytes: int = Field(
        64 * 2**20, ge=4096, le=2**40, description="Most bytes of samples.jsonl: the file is only appended to, "
        "and a row that would pass this bound is not written (counted in the trainer's log)."
    )
    max_text_chars: int = Field(
        4000, ge=16, le=1_000_000, description="Most characters of each prompt and completion text kept (the "
        "rest is cut, marked with `truncated`)."
    )


class OffPolicyCorrectionSpec(Model):
    """Trainer/sampler mismatch correction (definitions: rlkube.core.training.losses, docs/design.md §6)."""

    mode: Literal["none", "tis", "mis"] = Field(
        "none", description="none: the PPO ratio is against the sampler's log-probs (as before). tis: truncated "
        "importance sampling, weight min(pi_trainer/pi_sampler, cap). mis: masked importance sampling, tokens "
        "(or sequences) whose weight is outside [lower, cap] drop out. tis and mis take the PPO ratio against the "
        "trainer's own log-probs at the step (decoupled PPO): with one optimizer step per batch that ratio is 1, so "
        "clipEpsilonLow/clipEpsilonHigh no longer bind and cap (and lower) bound the update.")
    level: Literal["token", "sequence"] = Field(
        "token", description="token: one weight per token; sequence: one per sequence, the product of its token "
        "ratios.")
    cap: float = Field(2.0, ge=1, le=1e6, description="Upper bound of the importance weight (tis truncates, mis "
                       "masks above it).")
    lower: float | None = Field(None, ge=0, le=1, description="mis: lower bound of the weight (unset: 1 / cap).")

    @model_validator(mode="after")
    def _bounds(self) -> OffPolicyCorrectionSpec:
        if self.lower is not None and self.mode != "mis":
            raise ValueError("lower is for mode mis")
        return self


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
    filter_zero_advantage_groups: bool = Field(
        True,
        description="Drop groups whose rewards are all equal (zero advantage: nothing to learn) before training, "
        "counted in the trainer's filtered_groups/filtered_samples metrics; the actors sample more in their place. "
        "Not applied with loss sft.",
    )
    max_consecutive_filtered_groups: int | None = Field(
        None, ge=0, le=10**9,
        description="Most zero-advantage groups a preprocessor replica filters in a row (none becoming documents) "
        "before the job fails with reason ZeroAdvantageStall: a collapsed policy or a task far too hard or easy "
        "would otherwise sample forever while the trainer waits. Unset: 10 steps' worth of groups, at least 200. "
        "0: no bound.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the actors.")
    max_new_tokens: int = Field(8, ge=1, description="Most tokens generated per completion.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Gradient norm clip.")
    off_policy_correction: OffPolicyCorrectionSpec = Field(
        default_factory=OffPolicyCorrectionSpec,
        description="Importance-sampling correction of the trainer/sampler mismatch (off by default).")
    kl_coef: float = Field(
        0.0, ge=0, le=1e3, description="Weight of the k3 KL to a frozen copy of the initial model, added to the "
        "loss (torch backend without FSDP; costs one extra copy of the weights in spec.model.dtype). 0: off.")


class CheckpointSpec(Model):
    path: str = Field("/checkpoints", min_length=1, description="Directory for checkpoints inside the trainer.")
    claim_name: str | None = Field(
        None, min_length=1, description="PersistentVolumeClaim mounted at `path`; emptyDir when unset."
    )
    interval_steps: int = Field(10, ge=1, description="Save a checkpoint every this many steps (and at the end).")


class WeightTransferSpec(Model):
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype weights travel in to the inference servers (`auto`: the dtype they serve, "
        "spec.model.dtype, checked when each server joins the weight-update group); each server converts them to "
        "the dtype it serves.",
    )
    bucket_megabytes: int = Field(
        64, ge=1, description="Size of one transfer bucket: several tensors flattened into one collective."
    )


LORA_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Every linear layer of a Llama/Qwen decoder block (PEFT matches these against the end of module names)."""


class LoraSpec(Model):
    """Train a LoRA adapter instead of the full weights (PEFT; rlkube.core.training.lora, docs/design.md §6)."""

    rank: int = Field(8, ge=1, le=4096, description="LoRA rank r of every adapted layer.")
    alpha: float = Field(16.0, gt=0, le=1e6, description="LoRA alpha: the update B@A is scaled by alpha / rank.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input while training (0: the trainer's log-probs "
        "equal the sampler's on the same weights; > 0 makes them differ by the dropout noise).")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_DEFAULT_TARGETS), min_length=1,
        description="Module names (suffixes of the model's Linear layers) that get an adapter; default: every "
        "linear layer of the decoder blocks (embeddings and the LM head stay frozen).")


FastLLMModelFormat = Literal["llama", "qwen2", "mistral", "mixtral"]
"""Fast-LLM checkpoint formats of the Hugging Face models it imports and exports (their config.json model_type)."""


class FastLLMSpec(Model):
    model_format: FastLLMModelFormat | None = Field(
        None,
        description=(
            "Backend fast-llm: the Fast-LLM checkpoint format of spec.model.path, i.e. the `model_type` of its "
            "config.json (llama, qwen2, mistral, mixtral). Fast-LLM imports the model and exports and broadcasts "
            "the weights in this format. Required with backend fast-llm."
        ),
    )
    data_timeout_seconds: float = Field(
        3600.0,
        gt=0,
        le=7 * 86400,
        description=(
            "Backend fast-llm: how long Fast-LLM's trainer waits for its next document before it fails (its "
            "streaming dataset's `timeout`; Fast-LLM's default, 600 s, is shorter than a run of zero-advantage "
            "groups the preprocessor filters, up to spec.algorithm.maxConsecutiveFilteredGroups, or slow agent "
            "episodes can take). Give the actors time to sample that many groups."
        ),
    )
    broadcast_timeout_seconds: float = Field(
        7200.0,
        gt=0,
        le=7 * 86400,
        description=(
            "Backend fast-llm: the weight broadcast's timeout, the same on both sides: Fast-LLM's (its streaming "
            "callback's `timeout`) and every inference server's, which waits in the broadcast from one update to "
            "the next, so through the trainer's whole wait for documents and a step: must exceed "
            "dataTimeoutSeconds. It also bounds how long the servers wait for the trainer to start."
        ),
    )


class MegatronSpec(Model):
    tensor_parallel: int = Field(
        1,
        ge=1,
        description=(
            "Backend megatron: tensor-parallel size, the ranks that split each layer (attention heads, MLP and "
            "vocabulary shards); data parallel is the trainer's ranks (nodes x processes per node) / tensorParallel. "
            "Must divide the ranks and the model's attention heads, key/value heads, intermediate size and vocabulary."
        ),
    )


class TrainerSpec(Model):
    backend: Literal["torch", "megatron", "fast-llm"] = Field("torch", description="Training backend.")
    nodes: int = Field(1, ge=1, description="Trainer pods (one per node); ranks get a headless Service.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per trainer pod (0 = CPU).")
    processes_per_node: int | None = Field(
        None,
        ge=1,
        description=(
            "Training processes (ranks) per trainer pod, as torchrun's --nproc-per-node. Default: gpusPerNode (one "
            "per GPU), or 1 on CPU. With GPUs it must equal gpusPerNode; on CPU, more than 1 runs that many gloo "
            "ranks in each pod."
        ),
    )
    image: str | None = Field(None, min_length=1, description="Image of the trainer pods (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each trainer pod.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    micro_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Token budget of one forward/backward pass (rows x padded length); a step accumulates as many "
        "micro-batches as its documents need (a longer document gets a micro-batch of its own).",
    )
    sharding: Literal["none", "fsdp"] = Field(
        "none",
        description="Backend torch with several ranks: 'none' replicates the model on every rank (gradients "
        "all-reduced); 'fsdp' shards parameters, gradients and optimizer state over all ranks (FSDP2).",
    )
    cpu_offload: bool = Field(
        False,
        description="With sharding 'fsdp': keep the parameter shards, their gradients and Adam's state in host "
        "memory between uses and run the optimizer step on the CPU (FSDP2's CPUOffloadPolicy): less GPU memory, "
        "slower steps.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass (less memory, about a third more compute)."
    )
    weight_transfer: WeightTransferSpec = Field(
        default_factory=WeightTransferSpec, description="How weights are sent to the inference servers."
    )
    lora: LoraSpec | None = Field(
        None,
        description="Train a LoRA adapter on the frozen base model (backend torch, with or without FSDP). Weight updates "
        "carry the adapter only to the native engine (vLLM gets the merged weights) and checkpoints are PEFT "
        "adapter directories (adapter_config.json, adapter_model.safetensors). Unset: full-weight training.",
    )
    template: PodTemplate | None = Field(None, description=TEMPLATE_DESCRIPTION)
    fast_llm: FastLLMSpec = Field(default_factory=FastLLMSpec, description="Settings of backend fast-llm.")
    megatron: MegatronSpec = Field(default_factory=MegatronSpec, description="Settings of backend megatron.")


class VllmSpec(Model):
    """Engine arguments of `engine: vllm` (rlkube.core.inference.vllm_engine); the defaults serve a tiny model on CPU."""

    max_model_length: int | None = Field(
        None, ge=8, description="vLLM's max_model_len (default: spec.model.maxSequenceLength)."
    )
    memory_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description=(
            "vLLM's gpu_memory_utilization: the share of the accelerator's memory vLLM may take (weights, "
            "activations, KV cache); on CPU the share of the machine's memory. Default 0.9 with GPUs, 0.1 on CPU "
            "(vLLM's own 0.92 would claim most of a shared machine)."
        ),
    )
    enforce_eager: bool | None = Field(
        None, description="No CUDA graphs (default: true on CPU, where vLLM has none, false with GPUs)."
    )
    extra_engine_args: list[str] = Field(
        default_factory=list,
        description=(
            "More vLLM engine arguments in command-line form, e.g. [\"--max-num-seqs=64\", \"--seed=3\"]; they "
            "come last, so they override the ones rlkube sets."
        ),
    )


class InferenceSpec(Model):
    engine: Literal["vllm", "native"] = Field(
        "vllm", description="`vllm`, or `native` (a small torch server for CPU tiny models)."
    )
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="vLLM engine arguments (engine `vllm` only).")
    replicas: int = Field(1, ge=1, description="Inference servers; each joins the weight-update group.")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel size of each server.")
    placement: Literal["separate", "colocated"] = Field(
        "separate",
        description=(
            "`separate`: each inference server runs in a pod (local: a process) of its own, on devices of its own. "
            "`colocated`: the native engine shares the trainer's pod and devices: the trainer pod runs both "
            "processes (rlkube.core.launch.colocated) and holds the GPU once, so a one-GPU machine runs a GPU "
            "job; needs engine native, replicas 1, one trainer pod with one process, backend torch "
            "(docs/guide/colocated.md)."
        ),
    )
    device_memory_fraction: float = Field(
        0.3,
        gt=0,
        lt=1,
        description=(
            "With placement `colocated` on a GPU: the share of the GPU's memory the engine may allocate "
            "(torch.cuda.set_per_process_memory_fraction); the trainer may take the rest. Ignored on CPU."
        ),
    )
    image: str | None = Field(None, min_length=1, description="Image (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each server.")
    template: PodTemplate | None = Field(None, description=TEMPLATE_DESCRIPTION)


class WorkerSpec(Model):
    replicas: int = Field(1, ge=1, description="Pods of this role.")
    image: str | None = Field(None, min_length=1, description="Image (default: spec.image).")
    resources: Resources = Field(default_factory=Resources, description="Resources of each pod.")
    template: PodTemplate | None = Field(None, description=TEMPLATE_DESCRIPTION)


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
    template: PodTemplate | None = Field(None, description=TEMPLATE_DESCRIPTION + " Managed mode only.")


RestartPolicy = Literal["OnFailure", "Never"]


class SandboxPoolSpec(Model):
    """Where code-execution snippets run (docs/guide/sandbox.md): in the actor's process (`process`), or in a pool of
    sandbox pods per job (`pods`): HTTP servers (rlkube.core.sandbox) the actors reach inside the job's
    NetworkPolicy, started before the actors and torn down right after them."""

    mode: Literal["process", "pods"] = Field(
        "process", description="`process`: each snippet runs as a child of the actor, in its pod; `pods`: in the "
        "job's sandbox pods (needs spec.task.environment).")
    replicas: int = Field(1, ge=1, le=1000, description="Sandbox pods (mode pods).")
    runtime_class_name: str | None = Field(
        "gvisor", min_length=1, description="RuntimeClass of the sandbox pods (the chart installs `gvisor` for a "
        "runsc handler when sandbox.runtimeClass.create); unset: the cluster's default runtime.")
    require_network_namespace: bool = Field(
        True, description="A sandbox server exits (a configuration error naming runtimeClassName) unless each "
        "snippet can get a network namespace of its own: true under gVisor, refused under runc's default seccomp "
        "profile. False: rely on the audit hook and the NetworkPolicy alone.")
    concurrency: int = Field(4, ge=1, le=256, description="Snippets one sandbox pod runs at once; more wait.")
    image: str | None = Field(None, min_length=1, description="Image (default: spec.image).")
    resources: Resources = Field(
        default_factory=lambda: Resources(limits={"cpu": "1", "memory": "1Gi", "ephemeral-storage": "1Gi"}),
        description="Resources of each sandbox pod; limits on cpu, memory and ephemeral-storage are required.")
    template: PodTemplate | None = Field(None, description=TEMPLATE_DESCRIPTION)


class RestartPolicies(Model):
    trainer: RestartPolicy = Field(
        "OnFailure", description="Recreate a failed trainer (resuming from its checkpoint) while backoffLimit allows."
    )
    inference: RestartPolicy = Field("OnFailure", description="Recreate failed inference servers.")
    actor: RestartPolicy = Field("OnFailure", description="Recreate failed actors in place; the job continues.")
    preprocessor: RestartPolicy = Field("OnFailure", description="Recreate a failed preprocessor.")

    def of(self, role: Role) -> RestartPolicy:
        """The pod restartPolicy of `role`: Redis and sandbox pods always restart in place."""
        match Role(role):
            case Role.TRAINER:
                return self.trainer
            case Role.INFERENCE:
                return self.inference
            case Role.ACTOR:
                return self.actor
            case Role.PREPROCESSOR:
                return self.preprocessor
            case _:
                return "Always"


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
        le=MAX_SECONDS,
        description="How long one completion signal (trainer exit 0, or training_finished) may wait for the other.",
    )
    event_timeout_seconds: int = Field(
        900, ge=0, le=MAX_SECONDS, description="No trainer event for this long while Running sets Stalled (0 disables)."
    )
    fail_on_stall: bool = Field(False, description="Fail the job when it is Stalled instead of only reporting it.")
    image_pull_timeout_seconds: int = Field(
        300, ge=0, le=MAX_SECONDS, description="A pod that cannot pull its image (ErrImagePull, ImagePullBackOff) "
        "for this long (from the first failed pull) fails the job (ImagePullFailed), naming the image field; 0: wait. "
        "An image name the kubelet cannot parse, or imagePullPolicy Never with the image absent, fails it at once.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=MAX_SECONDS, description="Delete the TrainingJob this long after it finished (unset: keep)."
    )
    suspend: bool = Field(False, description="Stop all pods (ordered) and keep the job; unset to resume.")


class GracePeriods(Model):
    actor: int = Field(30, ge=0, le=MAX_SECONDS, description="Seconds actors get to stop before they are force-deleted.")
    preprocessor: int = Field(30, ge=0, le=MAX_SECONDS, description="Seconds the preprocessor gets to stop.")
    inference: int = Field(30, ge=0, le=MAX_SECONDS, description="Seconds inference servers get to stop.")
    trainer: int = Field(60, ge=0, le=MAX_SECONDS, description="Seconds trainer pods get to stop.")
    redis: int = Field(30, ge=0, le=MAX_SECONDS, description="Seconds Redis gets to stop.")
    sandbox: int = Field(5, ge=0, le=MAX_SECONDS, description="Seconds sandbox pods get to stop.")

    def of(self, role: Role) -> int:
        """The grace period of `role`'s pods, in seconds."""
        return {Role.ACTOR: self.actor, Role.PREPROCESSOR: self.preprocessor, Role.INFERENCE: self.inference,
                Role.TRAINER: self.trainer, Role.REDIS: self.redis, Role.SANDBOX: self.sandbox}[Role(role)]


class TeardownSpec(Model):
    grace_period_seconds: GracePeriods = Field(
        default_factory=GracePeriods, description="Grace period of each teardown stage, then force delete."
    )
    keep_trainer_pod: bool = Field(
        False, description="Leave finished trainer pods in place so their logs stay readable."
    )


class TrainingJobSpec(Model):
    """Desired state of a TrainingJob: model, task and reward, RL algorithm, and the pods of every role."""

    image: str = Field(
        "ghcr.io/rlkube/core:0.1.0", min_length=1, description="Default image of every role's pods."
    )
    model: ModelSpec = Field(..., description="The model (a Hugging Face directory) every role loads.")
    task: TaskSpec = Field(default_factory=TaskSpec, description="Rollout environment and reward.")
    evaluation: EvaluationSpec | None = Field(
        None, description="Score held-out prompts every N weight versions while training (unset: no evaluation)."
    )
    algorithm: AlgorithmSpec = Field(..., description="RL algorithm and its hyper-parameters.")
    samples: SamplesSpec = Field(
        default_factory=SamplesSpec, description="Rollout samples kept in the trainer's output for people to read."
    )
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer pods.")
    inference: InferenceSpec = Field(default_factory=InferenceSpec, description="Inference servers.")
    actor: WorkerSpec = Field(default_factory=WorkerSpec, description="Actors (rollout producers).")
    preprocessor: WorkerSpec = Field(default_factory=WorkerSpec, description="Preprocessors.")
    redis: RedisSpec = Field(default_factory=RedisSpec, description="The Redis that connects the roles.")
    sandbox: SandboxPoolSpec = Field(default_factory=SandboxPoolSpec, description="Where code-execution snippets "
                                     "run: in the actor's process, or in sandbox pods.")
    run_policy: RunPolicy = Field(default_factory=RunPolicy, description="Restarts, timeouts, suspend.")
    teardown: TeardownSpec = Field(default_factory=TeardownSpec, description="Ordered teardown settings.")
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec, description="Experiment trackers (MLflow, Weights & Biases, TensorBoard) the "
        "trainer logs to; none by default.")

    def section(self, role: Role) -> TrainerSpec | InferenceSpec | WorkerSpec | RedisSpec | SandboxPoolSpec:
        """The spec section of `role` (spec.trainer, spec.inference, ...): its replicas, resources, image, template."""
        return {Role.TRAINER: self.trainer, Role.INFERENCE: self.inference, Role.ACTOR: self.actor,
                Role.PREPROCESSOR: self.preprocessor, Role.REDIS: self.redis, Role.SANDBOX: self.sandbox}[Role(role)]

    def template_for(self, role: Role) -> PodTemplate | None:
        return self.section(role).template

    def image_for(self, role: Role) -> str:
        if role == Role.REDIS:
            return self.redis.image
        return self.section(role).image or self.image

    def image_field(self, role: Role) -> str:
        """The field that sets `image_for(role)`: the role's own image, or the job's `spec.image`."""
        if role == Role.REDIS:
            return "spec.redis.image"
        return f"spec.{role}.image" if self.section(role).image else "spec.image"

    def gpus_per_pod(self, role: Role) -> int:
        """GPUs per pod the operator requests: gpusPerNode for the trainer; tensorParallel for vLLM servers of a GPU
        job (the weight-update group runs over NCCL when the trainer is on GPUs, so both ends must be); else 0.

        A property of the spec (not of its validation): the pod builders and the resource checks both read it."""
        if role == Role.TRAINER:
            return self.trainer.gpus_per_node
        if role == Role.INFERENCE and self.inference.engine == "vllm" and self.trainer.gpus_per_node > 0:
            return self.inference.tensor_parallel
        return 0
