"""Fast-LLM's weight-broadcast rendezvous as the operator writes it into Fast-LLM's config and both engines join
it (pure: no torch, the operator imports it). The facts and their Fast-LLM file:line are in
rlkube.core.weights.fast_llm, the receiver."""

from __future__ import annotations

from rlkube.contract import runtime

EPOCH = "fast-llm"
"""What a Fast-LLM receiver reports as its epoch (Fast-LLM has one group per trainer run, no epochs)."""
WEIGHTS_SHARD = "weights"
"""The shard name of model weights in Fast-LLM's metadata (fast_llm/engine/checkpoint/huggingface.py:101); other shards
are received and dropped, as PipelineRL's receiver does."""

GENERATION_KEY = "rlkube/broadcast_generation"
"""The key of the broadcast store (hosted by the trainer pod's launcher, rlkube.core.launch.fast_llm) that names
its generation, a fresh value each time the launcher starts. Fast-LLM forms its group once per trainer run and
announces nothing before that group is complete, so a restarted trainer would wait in its group constructor for
receivers still in the dead one. The launcher writes the generation here and announces it in the trainer's events
(protocol.BROADCAST_OPENED) before Fast-LLM starts; a receiver reads it from the store it joined through, and on an
announcement of another generation leaves its group and joins the new one. Read from the store, not the events,
the generation is the one of the group actually joined, whatever the order of joins and announcements."""
GENERATION_WAIT_S = 5.0
"""How long a receiver waits for the generation key after its rendezvous (the launcher writes it right after
opening the store); a store without it (no rlkube launcher) is generation None."""

RECEIVER_TIMEOUT_S = 7200.0
"""spec.trainer.fastLlm.broadcastTimeoutSeconds' default (broadcast_timeout_s is a job's value)."""


def broadcast_timeout_s(spec) -> float:
    """The weight broadcast's timeout, the same on both sides: Fast-LLM's (`callbacks.streaming.timeout`, the
    timeout of its broadcast group, fast_llm/engine/training/streaming.py:49) and every receiving engine's
    rendezvous and collectives. A receiver waits in the broadcast from one update to the next, through the
    trainer's wait for documents (spec.trainer.fastLlm.dataTimeoutSeconds, which validation keeps shorter) and a
    step; before the first, for a trainer that may still be pulling its image or loading the model."""
    return float(spec.trainer.fast_llm.broadcast_timeout_seconds)


def external_world_size(spec) -> int:
    """`callbacks.streaming.broadcast.external_world_size`: every receiving rank, i.e. every tensor-parallel
    worker of every inference server (each receives the whole broadcast and keeps its shard)."""
    return runtime.weight_sync_world_size(spec) - 1


def world_size(spec) -> int:
    """The broadcast group's size: Fast-LLM's rank 0 plus the external ranks (fast_llm/engine/training/streaming.py:44)."""
    return external_world_size(spec) + 1


def store_prefix(size: int) -> str:
    """The PrefixStore of `get_process_group(range(size), 0)` (fast_llm/engine/training/streaming.py:54,
    fast_llm/engine/distributed/distributed.py:112-116)."""
    ranks = range(size)
    return f"range_{ranks.start}_{ranks.stop}_{ranks.step}/"


def broadcast_backend(spec) -> str:
    """`callbacks.streaming.broadcast.backend`, which the receivers use too: NCCL where the inference servers
    have GPUs (vLLM servers of a job whose trainer has GPUs: the operator's GPU rule for inference pods), as
    PipelineRL broadcasts; gloo where they serve on CPUs (the native engine), Fast-LLM's CPU path
    (fast_llm/engine/training/streaming.py:50: CPU buffers for any backend but NCCL)."""
    return "nccl" if spec.inference.engine == "vllm" and spec.trainer.gpus_per_node > 0 else "gloo"
