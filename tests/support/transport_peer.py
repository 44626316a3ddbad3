"""The trainer's side of tests/integration/weights/test_weight_transport_join.py, run as its own process (not a test).

`python transport_peer.py ADDR REDIS_URL DEVICE SPEC_JSON_PATH`: builds the weight publisher exactly as the trainer
does (rlkube.core.trainer.publishers._make_publisher) for the job spec in SPEC_JSON_PATH, as if this trainer ran on
DEVICE (`cuda` here needs no CUDA: the transport handshake runs before any NCCL call; on a machine without CUDA
the buckets are packed in host memory, the only thing that differs from a GPU trainer), prints
`transport <backend> <device>`, pushes version 0 of weightsync_peer.make_weights and prints `published 0`, or
`error <type>: <message>` and exits 1. EOF on stdin closes the publisher.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import redis
import torch
from rlkube.contract.context import RoleContext
from rlkube.core.trainer.publishers import _make_publisher
from rlkube.core.weights.wire import pack_weights
from rlkube.lifecycle.validation import parse_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the support package
from support.weightsync_peer import make_weights  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="peer %(levelname)s %(message)s")
    addr, url, device, spec_path = sys.argv[1:]
    spec = parse_spec(json.loads(Path(spec_path).read_text()))
    ctx = RoleContext(namespace="ns", job="j", spec=spec, redis_url=url, weight_sync_addr=addr)
    pub = _make_publisher(ctx, redis.Redis.from_url(url), device)
    print(f"transport {pub.sender.backend} {pub.sender.device}", flush=True)
    if pub.sender.device.type == "cuda" and not torch.cuda.is_available():
        sender = pub.sender
        sender.pack = lambda named: pack_weights(named, sender.transfer_dtype, sender.bucket_bytes, "cpu")
    try:
        pub.start(make_weights(0).items(), version=0)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    print("published 0", flush=True)
    sys.stdin.read()
    pub.close()


if __name__ == "__main__":
    main()
