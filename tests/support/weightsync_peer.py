"""A trainer-side weight publisher run as its own process by the weight-sync and inference tests (not a test).

`python weightsync_peer.py ADDR WORLD REDIS_URL PREFIX START_VERSION [JOB_CONFIG]`: starts a WeightPublisher
(announces a new epoch with START_VERSION and sends it; with JOB_CONFIG the weights are the job's tiny model
nudged per version, else small test tensors), then publishes one version per line read from stdin (`VERSION
[DOCUMENTS_SEEN]`), printing `published <version>` after each; EOF closes the publisher. The watchdog answers rejoin
requests meanwhile. PEER_OVERLAP=1 overlaps transfers; PEER_TRANSFER_DTYPE (e.g. bfloat16) and PEER_BUCKET_BYTES set the
publisher's transfer dtype and bucket size. PEER_CORRUPT_VERSIONS (comma-separated) sends those versions with one value
of their first bucket changed after the checksum was taken, as a transfer that corrupts data would (the receivers must
refuse them). PEER_BF16_VERSIONS (comma-separated) sends those versions in bfloat16 whatever PEER_TRANSFER_DTYPE says
(an fp32 trainer with a bf16 transfer dtype), with a nudge of BF16_SCALE whatever the version (weights of a trainer's
usual scale: larger versions' nudges saturate the tiny model, whose sampled tokens then have log-probs of exactly 0).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import redis
import torch
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import load_model
from rlkube.core.hf.source import materialize_model
from rlkube.contract.protocol import StreamKeys
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import DEFAULT_BUCKET_BYTES, pack_weights


BF16_SCALE = 0.5


def make_weights(version: int) -> dict[str, torch.Tensor]:
    """Deterministic per version, with several dtypes, so the receiver can check every byte."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "layer.weight": torch.randn(16, 8, generator=g),
        "layer.bias_bf16": torch.randn(8, generator=g).to(torch.bfloat16),
        "counter": torch.arange(5, dtype=torch.int64) + version,
    }


def model_weights(config_path: str, version: int, scale: float | None = None) -> dict[str, torch.Tensor]:
    """The job's tiny model (HF names, each tied weight once) as a trainer would have it after `version` steps:
    its initial weights plus a seeded nudge of `scale` (default 0.5 x version) x standard normal noise."""
    spec = parse_spec(json.loads(Path(config_path).read_text())["spec"])
    state = hf_state.named_weights(load_model(materialize_model(spec.model)))
    g = torch.Generator().manual_seed(version)
    scale = 0.5 * version if scale is None else scale
    return {k: v + scale * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in state.items()}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="peer %(levelname)s %(message)s")
    addr, world, url, prefix, first, *config = sys.argv[1:]

    bf16 = {int(v) for v in os.environ.get("PEER_BF16_VERSIONS", "").split(",") if v}

    def weights(version: int) -> dict[str, torch.Tensor]:
        if not config:
            return make_weights(version)
        return model_weights(config[0], version, BF16_SCALE if version in bf16 else None)

    client = redis.Redis.from_url(url)
    dtype = os.environ.get("PEER_TRANSFER_DTYPE")
    pub = WeightPublisher(client, StreamKeys(prefix), addr, int(world), timeout_s=20, watch_interval_s=0.1,
                          overlap=os.environ.get("PEER_OVERLAP") == "1",
                          transfer_dtype=getattr(torch, dtype) if dtype else None,
                          bucket_bytes=int(os.environ.get("PEER_BUCKET_BYTES", str(DEFAULT_BUCKET_BYTES))))
    if bf16:
        sender = pub.sender

        def pack_some_in_bf16(named_tensors):
            dtype = torch.bfloat16 if current[0] in bf16 else sender.transfer_dtype
            return pack_weights(named_tensors, dtype, sender.bucket_bytes, sender.device)

        sender.pack = pack_some_in_bf16
    corrupt = {int(v) for v in os.environ.get("PEER_CORRUPT_VERSIONS", "").split(",") if v}
    if corrupt:
        pack = pub.sender.pack

        def pack_corrupted(named_tensors):
            packed = pack(named_tensors)
            if current[0] in corrupt:
                packed.buffers[0][0] += 1.0
            return packed

        pub.sender.pack = pack_corrupted
    current = [int(first)]
    pub.start(weights(int(first)).items(), version=int(first))
    print(f"published {first}", flush=True)
    for line in sys.stdin:
        v, *seen = (int(x) for x in line.split())
        current[0] = v
        pub.publish(weights(v).items(), version=v, step=v, documents_seen=seen[0] if seen else v * 4)
        print(f"published {v}", flush=True)
    pub.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
