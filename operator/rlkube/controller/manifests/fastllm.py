"""`trainer.backend: fast-llm`: the Fast-LLM training config a job's ConfigMap carries, and the trainer container
that runs Fast-LLM's own launcher on it. Pure: no client, no I/O.

Why a module of its own: every name here is Fast-LLM's, not ours. The field names, their types and defaults were
taken from Fast-LLM's source at FAST_LLM_COMMIT and are recorded, with the file and line each one is declared at,
in tests/fixtures/fast_llm_config_fields.json (written by tests/support/fast_llm_fields.py, which imports Fast-LLM's own
config classes); tests/unit/test_fast_llm_config.py holds what this module writes to that record, field by field.

What the config says (spec -> Fast-LLM):
- the model is imported from the job's Hugging Face checkpoint (`pretrained`, format = the checkpoint's
  `model_type`, given as spec.trainer.fastLlm.modelFormat);
- documents come from the Redis streaming dataset (`data.datasets.training`, type `streaming`): stream
  `fast_llm_streaming`, group `fast_llm_group`, the preprocessor's format (docs/design.md §5.4);
- one optimizer step per samplesPerStep documents (`schedule.docs_per_step`), maxSteps steps (`train_iters`);
- after every step the weights are announced in `fast_llm_events` and broadcast to the inference servers
  (`callbacks.<streaming>`), in the same Hugging Face format (`export`), so they travel under HF names;
- checkpoints and the final export go to the checkpoint volume (`run.experiment_dir`): Fast-LLM writes
  `{dir}/checkpoint/{step}` and `{dir}/export/{format}/{step}`, and resumes from the newest checkpoint there.

Redis password: Fast-LLM's RedisConfig has `host`, `port` and `timeout` only, and connects with
`redis.Redis(host, port)` (no password, no URL, no environment variable). So the config points Fast-LLM at a
loopback port inside its own pod, where rlkube.core.launch.fast_llm relays to the job's Redis after
authenticating with the password from the job's Secret: no Secret value is in the ConfigMap.
"""

from __future__ import annotations

from typing import Any

import yaml

from rlkube.api.role import Backend, Role
from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import checkpoint_loss, protocol, runtime
from rlkube.contract import fast_llm_rendezvous
from rlkube.controller.manifests import names

FAST_LLM_REPOSITORY = "ServiceNow/Fast-LLM"
FAST_LLM_COMMIT = "d3d20226a2395281eca4a779e85b8688621248d2"
"""Branch `jlp_rl_features` (Fast-LLM's RL features: `schedule.docs_per_step`), main up to 2026-07-15 merged in.
The trainer-fast-llm image installs this commit; the fixture records the fields at this commit."""

CONFIG_KEY = "fast-llm.yaml"
CONFIG_PATH = f"{names.CONFIG_MOUNT}/{CONFIG_KEY}"
MODEL_TYPE = "gpt"
"""`fast-llm train gpt`: the GPT trainer (GPTTrainerConfig), which imports llama/qwen2/mistral/mixtral checkpoints."""

LOSS_TYPES = {"grpo": "grpo", "gspo": "gspo"}
"""spec.algorithm.loss -> Fast-LLM's policy-gradient loss type (LanguageModelGRPOLossConfig, ...GSPOLossConfig)."""

REDIS_RELAY_HOST = "127.0.0.1"
"""Where Fast-LLM finds Redis inside its pod: rlkube.core.launch.fast_llm's authenticating relay."""
BROADCAST_STORE_HOST = "127.0.0.1"
"""Fast-LLM's rank 0 (on trainer pod 0) joins the broadcast group through the store pod 0's launcher hosts.
Loopback, as PipelineRL does, so rank 0 never depends on resolving its own DNS name."""
RENDEZVOUS_TIMEOUT_S = 3600
"""torchrun's static rendezvous waits this long for every trainer node (its default 600 s is short when each node
first pulls a large CUDA image); the value PipelineRL passes for multi-node Fast-LLM. Only the trainer's nodes
meet there: the broadcast's and the documents' timeouts are spec.trainer.fastLlm's."""
PYTHONHASHSEED = "42"
"""Fast-LLM warns unless every rank has the same PYTHONHASHSEED (fast_llm/utils.py); PipelineRL sets 42."""


def _loss(spec: TrainingJobSpec) -> dict[str, Any]:
    algo = spec.algorithm
    return {
        "type": LOSS_TYPES[algo.loss],
        "epsilon_low": algo.clip_epsilon_low,
        "epsilon_high": algo.clip_epsilon_high,
        # Fast-LLM's RL recipe: 1 / sampling temperature, so the trainer's log-probabilities are those the actors
        # sampled with (docs/recipes/reinforcement-learning.md, `logits_scale_factor`).
        "logits_scale_factor": 1.0 / algo.temperature,
    }


def training_config(spec: TrainingJobSpec, namespace: str, job: str) -> dict[str, Any]:
    """The Fast-LLM `train gpt` config of a job, as the dict its YAML file holds."""
    if spec.trainer.backend != Backend.FAST_LLM:
        raise ValueError(f"spec.trainer.backend is {spec.trainer.backend!r}, not fast-llm")
    algo, fast = spec.algorithm, spec.trainer.fast_llm
    fmt = fast.model_format
    if fmt is None:  # validation refuses this; a direct caller gets the same field name
        raise ValueError("spec.trainer.fastLlm.modelFormat is required with backend fast-llm")
    redis_relay = {"host": REDIS_RELAY_HOST, "port": runtime.REDIS_PORT}
    return {
        "run": {"experiment_dir": spec.trainer.checkpoint.path, "experiment_name": f"{namespace}/{job}"},
        "pretrained": {"format": fmt, "path": spec.model.path, "model_weights": True},
        "model": {
            "base_model": {"head": {"losses": {algo.loss: _loss(spec)}}},
            "distributed": {"compute_dtype": spec.model.dtype, "seed": spec.model.seed},
        },
        "schedule": {"docs_per_step": algo.samples_per_step},
        "data": {
            # Tokens per micro-batch: the preprocessor caps a document at maxSequenceLength tokens, and Fast-LLM
            # needs every document to fit one micro-batch (documents are never truncated for RL).
            "micro_batch_size": spec.model.max_sequence_length,
            "truncate_documents": False,
            "shuffle": "disabled",
            # How long Fast-LLM waits for a document (RedisConfig.timeout; its 600 s default is shorter than a
            # run of filtered zero-advantage groups may take).
            "datasets": {"training": {"type": "streaming", **redis_relay, "timeout": fast.data_timeout_seconds}},
        },
        "optimizer": {
            "learning_rate": {"base": algo.learning_rate},
            # Our trainers use plain Adam (no weight decay); Fast-LLM's default is 0.01.
            "weight_decay": 0.0,
            # Fast-LLM divides the step's loss by its document count, so its RL recipe scales the clip threshold
            # with docs_per_step to hold the effective clip (docs/recipes/reinforcement-learning.md).
            "gradient_norm_clipping": algo.grad_clip_norm * algo.samples_per_step,
        },
        "training": {
            "train_iters": algo.max_steps,
            # The streaming dataset refuses more than one loader process per rank.
            "num_workers": 1,
            "logs": {"interval": 1},
            "checkpoint": {"interval": spec.trainer.checkpoint.interval_steps},
            # One Hugging Face export, of the final weights (Fast-LLM also exports when training ends).
            "export": {"format": fmt, "interval": algo.max_steps},
        },
        "callbacks": {
            "streaming": {
                "type": "streaming",
                **redis_relay,
                # The broadcast group's timeout (RedisConfig.timeout of the callback, its ProcessGroupPool's):
                # the receivers use the same (rlkube.contract.fast_llm_rendezvous.broadcast_timeout_s).
                "timeout": fast_llm_rendezvous.broadcast_timeout_s(spec),
                "broadcast": {
                    "host": BROADCAST_STORE_HOST,
                    "port": runtime.WEIGHT_SYNC_PORT,
                    # Every receiving rank: each tensor-parallel worker of each inference server joins
                    # (replicas x tensorParallel; Fast-LLM adds its own rank 0, fast_llm/engine/training/
                    # streaming.py:44). rlkube.core.weights.fast_llm holds the rendezvous both engines follow.
                    "external_world_size": fast_llm_rendezvous.external_world_size(spec),
                    "backend": fast_llm_rendezvous.broadcast_backend(spec),
                },
                "export": {"format": fmt, "model_weights": True, "optimizer_state": False},
            }
        },
    }


def finished(spec: TrainingJobSpec) -> tuple[int, str]:
    """The step and checkpoint Fast-LLM's training_finished stands for: it sends one, with no fields, when its
    training loop ends (fast_llm/engine/training/trainer.py:208, after `_run_training`), and the loop ends early
    only on a signal (`training.shutdown` is not set), which makes torchrun exit non-zero; so with the trainer's exit
    0 it means train_iters (maxSteps) steps done, skipped updates included (Fast-LLM counts them), and the final
    checkpoint saved (`training.checkpoint` is saved when the loop stops, under run.experiment_dir)."""
    steps = spec.algorithm.max_steps
    return steps, checkpoint_loss.fast_llm_checkpoint(spec.trainer.checkpoint.path, steps)


def config_map_data(spec: TrainingJobSpec, namespace: str, job: str) -> dict[str, str]:
    """What a fast-llm job adds to its ConfigMap (nothing for the other backends)."""
    if spec.trainer.backend != Backend.FAST_LLM:
        return {}
    text = yaml.safe_dump(training_config(spec, namespace, job), sort_keys=False, default_flow_style=False)
    return {CONFIG_KEY: text}


def launcher_command(spec: TrainingJobSpec, job: str, node: int, rendezvous_port: int) -> list[str]:
    """torchrun running `fast-llm train gpt --config ...` on trainer node `node`, as PipelineRL launches it.

    Static rendezvous: node ranks are the pod indices, so global rank 0 (the rank that publishes events and
    broadcasts weights) is on pod 0, where the broadcast store and the Service's DNS name are."""
    trainer = spec.trainer
    return [
        "torchrun",
        f"--nnodes={trainer.nodes}",
        f"--nproc-per-node={trainer.gpus_per_node}",
        f"--node-rank={node}",
        "--rdzv-backend=static",
        f"--master-addr={names.trainer_host(job, 0)}",
        f"--master-port={rendezvous_port}",
        f"--rdzv-conf=timeout={RENDEZVOUS_TIMEOUT_S}",
        # The operator restarts failed trainer pods (runPolicy.backoffLimit); Fast-LLM resumes from its checkpoint.
        "--max-restarts=0",
        "--no-python",
        "fast-llm", "train", MODEL_TYPE, "--config", CONFIG_PATH,
    ]


def pod_command(spec: TrainingJobSpec, job: str, node: int, rendezvous_port: int, image: str | None = None
                ) -> list[str]:
    """The trainer container's command: our small launcher (Redis relay; on node 0 the broadcast store and the
    checkpoint check), then torchrun. `image` is named if the image lacks a command."""
    relay = f"{REDIS_RELAY_HOST}:{runtime.REDIS_PORT}"
    upstream = f"{names.service_name(job, Role.REDIS)}:{runtime.REDIS_PORT}"
    cmd = ["python", "-m", "rlkube.core.launch.fast_llm", "--redis-listen", relay, "--redis-upstream", upstream]
    if image:
        cmd += ["--image", image]
    if node == 0:
        cmd += ["--broadcast-store-port", str(runtime.WEIGHT_SYNC_PORT),
                # Fast-LLM's checkpoints (run.experiment_dir, training.checkpoint.interval) and its events stream.
                "--checkpoint-dir", spec.trainer.checkpoint.path,
                "--checkpoint-interval", str(spec.trainer.checkpoint.interval_steps),
                "--events-stream", protocol.EVENTS_STREAM]
    return cmd + ["--", *launcher_command(spec, job, node, rendezvous_port)]


def trainer_container(container: dict, spec: TrainingJobSpec, job: str, node: int, rendezvous_port: int) -> dict:
    """The builders' trainer container turned into a Fast-LLM one: command and environment replaced, the rest
    (image, resources, config and checkpoint mounts, ports) kept."""
    password = [e for e in container["env"] if e["name"] == runtime.ENV_REDIS_PASSWORD]
    env = [
        # The relay's credential, from the job's Secret (validation allows fast-llm only with the managed Redis).
        *password,
        # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each Fast-LLM process itself.
        {"name": "PYTHONHASHSEED", "value": PYTHONHASHSEED},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if ports.get("weight-sync") != runtime.WEIGHT_SYNC_PORT or ports.get("rendezvous") != rendezvous_port:
        raise ValueError(f"trainer container ports {ports} are not the weight-sync and rendezvous ports")
    return {**container, "command": pod_command(spec, job, node, rendezvous_port, container.get("image")),
            "env": env}
