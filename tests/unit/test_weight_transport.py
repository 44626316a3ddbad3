"""The one weight-transport rule (rlkube.contract.weight_transport): the table over (trainer device, engine device,
placement, inference engine) -> transport, and that the publisher the trainer builds and every receiver (the native
engine's, each vLLM worker's) derive the same transport and transfer dtype from it."""

from __future__ import annotations

import pytest
import torch
from rlkube.contract import weight_transport as wt
from rlkube.contract.context import RoleContext
from rlkube.core.inference.native_engine import weight_receiver
from rlkube.core.inference.vllm_engine import weight_group
from rlkube.core.trainer.publishers import _make_publisher
from rlkube.core.weights.group import WeightReceiver, WeightSender
from rlkube.lifecycle.validation import parse_spec
from support.specs import spec as spec_doc

pytestmark = pytest.mark.unit

ADDR = "127.0.0.1:29999"  # never dialled: building publishers and receivers touches no network

# (trainer device, engine device, placement) -> transport: the rule itself.
RULE = [
    ("cpu", "cpu", wt.SEPARATE, wt.GLOO),
    ("cuda", "cpu", wt.SEPARATE, wt.GLOO),
    ("cpu", "cuda", wt.SEPARATE, wt.GLOO),
    ("cuda", "cuda", wt.SEPARATE, wt.NCCL),
    ("cuda:0", "cuda:3", wt.SEPARATE, wt.NCCL),
    ("cuda", "cuda", wt.COLOCATED, wt.GLOO),  # one GPU: through host memory (the zero-copy cuda-ipc is not built)
    ("cpu", "cpu", wt.COLOCATED, wt.GLOO),
    ("cuda", "cpu", wt.COLOCATED, wt.GLOO),
]


@pytest.mark.parametrize(("trainer", "engine", "placement", "expected"), RULE)
def test_the_rule(trainer, engine, placement, expected):
    assert wt.transport(trainer, engine, placement) == expected


def test_an_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="placement 'shared'"):
        wt.transport("cpu", "cpu", "shared")


def ctx_for(gpus: int, engine: str, **overrides) -> RoleContext:
    spec = parse_spec(spec_doc(**{"trainer.gpusPerNode": gpus, "inference.engine": engine, **overrides}))
    return RoleContext(namespace="ns", job="j", spec=spec, redis_url="redis://unused", weight_sync_addr=ADDR)


# (trainer device, engine device, placement, inference engine) -> transport, as each side builds it: the trainer's
# device is the trainer's own (the spec asks for GPUs), the engine's what that engine runs on for this spec.
TABLE = [
    ("cpu", "cpu", wt.SEPARATE, "native", wt.GLOO),
    ("cpu", "cpu", wt.SEPARATE, "vllm", wt.GLOO),
    ("cuda", "cpu", wt.SEPARATE, "native", wt.GLOO),  # the GPU job with native engines: NCCL on main, never formed
    ("cuda", "cuda", wt.SEPARATE, "vllm", wt.NCCL),
    ("cpu", "cpu", wt.COLOCATED, "native", wt.GLOO),  # spec.inference.placement colocated: loopback gloo
    ("cuda", "cuda", wt.COLOCATED, "native", wt.GLOO),  # the engine on the trainer's GPU: NCCL cannot pair them
]


@pytest.mark.parametrize(("trainer", "engine", "placement", "backend", "expected"), TABLE)
def test_publisher_and_every_receiver_derive_the_same_transport(trainer, engine, placement, backend, expected):
    ctx = ctx_for(1 if trainer == "cuda" else 0, backend, **{"inference.placement": placement})
    assert wt.placement(ctx.spec) == placement
    assert wt.engine_device(ctx.spec) == engine
    publisher = _make_publisher(ctx, None, trainer)  # built as the trainer builds it, on `trainer`
    assert publisher.sender.backend == expected
    # Over gloo the buckets are packed in host memory, over NCCL on the trainer's GPU.
    assert publisher.sender.device.type == ("cuda" if expected == wt.NCCL else "cpu")
    if backend == "native":
        # the native engine samples on the CPU, or on the trainer's GPU when colocated; gloo receives on the host
        receiver = weight_receiver(ctx)
        assert (receiver.backend, receiver.device.type) == (expected, "cpu")
    else:
        g = weight_group(ctx)  # what each vLLM worker's rlkube_join derives its transport from, with its device
        assert wt.transport(g.trainer_device, engine, g.placement) == expected
    assert wt.receiver_transport(ctx.spec, engine) == wt.publisher_transport(ctx.spec, trainer) == expected


@pytest.mark.parametrize(("served", "transfer", "expected"), [
    ("float32", "auto", torch.float32), ("bfloat16", "auto", torch.bfloat16), ("bfloat16", "float32", torch.float32),
])
def test_auto_transfer_dtype_is_the_served_dtype_on_both_sides(served, transfer, expected):
    ctx = ctx_for(0, "native", **{"model.dtype": served, "trainer.weightTransfer.dtype": transfer})
    assert _make_publisher(ctx, None, "cpu").sender.transfer_dtype == expected
    assert weight_receiver(ctx).transfer_dtype == str(expected).removeprefix("torch.")
    assert weight_group(ctx).transfer_dtype == str(expected).removeprefix("torch.")


def test_the_same_device_transport_is_refused_by_both_ends_until_it_is_built():
    with pytest.raises(ValueError, match="cuda-ipc.*colocated"):
        WeightSender(ADDR, 2, backend=wt.CUDA_IPC, device="cuda")
    with pytest.raises(ValueError, match="cuda-ipc.*colocated"):
        WeightReceiver(ADDR, rank=1, world_size=2, backend=wt.CUDA_IPC, device="cuda")
