"""The one rule that says how weights travel from the trainer to an inference engine (docs/design.md §5.6), read by
the publisher and by every receiver alike, so both ends of the weight-update group always pick the same transport:

    trainer device   engine device   placement    transport
    cuda             cuda            separate     nccl       (two GPUs: NCCL between them)
    cuda             cuda            colocated    gloo       (one GPU: NCCL puts no two ranks on one device)
    anything else (a CPU on either side)          gloo       (host memory; a GPU side copies through the host)

Each side knows its own device and reads the other's from the spec (`trainer_device`, `engine_device`); the
publisher writes what it derived into the group's store before anyone joins, and a receiver that derived
something else refuses to join, naming both (rlkube.core.weights.group: the join handshake). A colocated placement
(spec.inference.placement, docs/guide/colocated.md) on a GPU goes through host memory over loopback gloo: the
trainer packs each bucket on the host, the engine copies it onto the shared GPU. `cuda-ipc` (the engine mapping the
trainer's buckets, zero-copy) is the faster answer for that row; its transfer is not built, so the rule does not
return it and rlkube.core.weights.group refuses it by name.

Also here: what `weightTransfer.dtype: auto` means (the dtype the engine serves). Pure: no torch.
"""

from __future__ import annotations

from rlkube.api.role import Role

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
    if device_type(trainer_device) == "cuda" and device_type(engine_device) == "cuda" and placement == SEPARATE:
        return NCCL
    return GLOO


def trainer_device(spec) -> str:
    """The trainer's device as the spec asks for it (what a receiver assumes of the trainer)."""
    return "cuda" if spec.trainer.gpus_per_node > 0 else "cpu"


def engine_device(spec) -> str:
    """An inference engine's device as the spec asks for it (what the publisher assumes of the engines): the
    native engine samples on the CPU, or on the trainer's GPU when colocated with it; a vLLM server holds GPUs when
    the job does (TrainingJobSpec.gpus_per_pod)."""
    if placement(spec) == COLOCATED:
        return trainer_device(spec)
    return "cuda" if spec.gpus_per_pod(Role.INFERENCE) > 0 else "cpu"


def placement(spec) -> str:
    """Where the engines run relative to the trainer: `spec.inference.placement`."""
    return spec.inference.placement


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
