"""Weight publication as the trainer sees it: the `Publisher` interface with its declared capabilities, the
announce-only publisher, and the choice between it and rlkube.core.weights.publication.WeightPublisher for a role.

The capabilities are attributes of the interface, read as such: `streams` (the publisher runs the passes of a
sharded trainer's StreamedWeights itself, so the trainer must not drain it) and `rejoin_pending` (an inference
server asked to rejoin and the publisher cannot resend from a snapshot: every rank must gather the weights again).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import redis
import torch

from rlkube.contract import protocol, weight_transport
from rlkube.contract.context import RoleContext
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import DTYPES

log = logging.getLogger("rlkube.trainer")


class Publisher(Protocol):
    """What the trainer needs from weight publication (rlkube.core.weights.publication.WeightPublisher has this
    shape and declares both capabilities on its class)."""

    streams: bool = False
    """`start`/`publish` take a StreamedWeights and run its passes (a sharded trainer's weights)."""
    rejoin_pending: bool = False
    """An inference server asked to rejoin and only a new gather of every rank can serve it (sharded)."""

    def start(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0, step: int | None = None,
              documents_seen: int = 0, **extra: Any) -> None: ...

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, step: int,
                documents_seen: int = 0, **extra: Any) -> None: ...

    def close(self) -> None: ...


class AnnounceOnly(Publisher):
    """Publishes `weights_ready` without transferring anything: for a trainer with no weight-update group
    (RLKUBE_WEIGHT_SYNC_ADDR unset), e.g. when inference loads checkpoints itself, or in tests."""

    def __init__(self, client: redis.Redis, keys: protocol.StreamKeys):
        self.redis, self.keys = client, keys

    def start(self, named_tensors, version: int = 0, step: int | None = None, documents_seen: int = 0,
              **extra: Any) -> None:
        self.publish(named_tensors, version, version if step is None else step, documents_seen, **extra)

    def publish(self, named_tensors, version: int, step: int, documents_seen: int = 0, **extra: Any) -> None:
        self.redis.xadd(self.keys.events, protocol.weights_ready(step, documents_seen, version=int(version), **extra))

    def close(self) -> None:
        pass


def _make_publisher(ctx: RoleContext, client: redis.Redis, device: str) -> Publisher:
    if not ctx.weight_sync_addr:
        log.info("%s unset: announcing weights without transferring them", "RLKUBE_WEIGHT_SYNC_ADDR")
        return AnnounceOnly(client, ctx.keys)
    spec = ctx.spec
    # The one rule both ends read (rlkube.contract.weight_transport): this trainer's device, the engines' from the
    # spec. Over gloo the buckets travel from host memory, so they are packed there.
    transport = weight_transport.publisher_transport(spec, device)
    return WeightPublisher(client, ctx.keys, ctx.weight_sync_addr, ctx.weight_sync_world_size,
                           backend=transport, device=device if transport == weight_transport.NCCL else "cpu",
                           transfer_dtype=DTYPES[weight_transport.transfer_dtype_name(spec)],
                           bucket_bytes=spec.trainer.weight_transfer.bucket_megabytes * 2**20)
