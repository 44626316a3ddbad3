"""The one rule that says how weights travel from the trainer to an inference engine (docs/design.md §5.6), read by
the publisher and by every receiver alike, so both ends of the weight-update group always pick the same transport:

    trainer device   engine device   placement    transport
    cuda             cuda            separate     nccl       (two GPUs: NCCL between them)
    cuda             cuda            colocated    cuda-ipc   (one GPU: the engine maps the trainer's buckets)
    anything else (a CPU on either side)          gloo       (host memory; a GPU side copies through the host)

Each side knows its own device and reads the other's from the spec (`trainer_device`, `engine_device`); the
publisher writes what it derived into the group's store before anyone joins, and a receiver that derived
something else refuses to join, naming both (rlkube.core.weights.group: the join handshake). `cuda-ipc` is the
rule's answer for a colocated placement; its transfer is not built yet, so both ends refuse it clearly.

Also here: what `weightTransfer.dtype: auto` means (the dtype the engine serves). Pure: no torch.
"""

from __future__ import annotations

NCCL = "nccl"
CUDA_IPC = "cuda-ipc"
GLOO = "gloo"
TRANSPORTS = (NCCL, CUDA_IPC, GLOO)
BUILT = (NCCL, GLOO)
"""The transports rlkube.core.weights.group can form a group over."""

SEPARATE = "separate"
COLOCATED = "colocated"
PLACEMENTS = (SEPARATE, COLOCATED)


class TransportMismatch(RuntimeError):
    """Publisher and receiver derived different transports (or transfer dtypes): a configuration error, raised at
    join on both sides within seconds instead of a group that never forms. Not retried."""


def device_type(device: str) -> str:
    """`cuda:1` -> `cuda`; `cpu` -> `cpu` (what the rule looks at)."""
    return str(device).split(":", 1)[0]


def transport(trainer_device: str, engine_device: str, placement: str = SEPARATE) -> str:
    """The transport between a trainer on `trainer_device` and an engine on `engine_device` (module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"weight-transport placement {placement!r} is not one of {PLACEMENTS}")
    if device_type(trainer_device) == "cuda" and device_type(engine_device) == "cuda":
        return CUDA_IPC if placement == COLOCATED else NCCL
    return GLOO


def trainer_device(spec) -> str:
    """The trainer's device as the spec asks for it (what a receiver assumes of the trainer)."""
    return "cuda" if spec.trainer.gpus_per_node > 0 else "cpu"


def engine_device(spec) -> str:
    """An inference engine's device as the spec asks for it (what the publisher assumes of the engines): the
    native engine samples on the CPU; a vLLM server holds GPUs when the job does (TrainingJobSpec.gpus_per_pod)."""
    return "cuda" if spec.gpus_per_pod("inference") > 0 else "cpu"


def placement(spec) -> str:
    """Where the engines run relative to the trainer: always on devices of their own today."""
    return SEPARATE


def publisher_transport(spec, own_device: str) -> str:
    """The publisher's side of the rule: its own device, the engines' from the spec."""
    return transport(own_device, engine_device(spec), placement(spec))


def receiver_transport(spec, own_device: str) -> str:
    """A receiver's side of the rule: the trainer's device from the spec, its own."""
    return transport(trainer_device(spec), own_device, placement(spec))


def transfer_dtype_name(spec) -> str:
    """`spec.trainer.weightTransfer.dtype` resolved: `auto` is the dtype the engines serve (`spec.model.dtype`,
    which both engines load and serve in), so no cast happens on arrival."""
    name = spec.trainer.weight_transfer.dtype
    return spec.model.dtype if name == "auto" else name
