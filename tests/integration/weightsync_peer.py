"""A trainer-side weight publisher run as its own process by test_weightsync.py (not a test module).

`python weightsync_peer.py ADDR WORLD REDIS_URL PREFIX START_VERSION`: starts a WeightPublisher (announces a
new epoch with START_VERSION and sends it), then publishes one version per line read from stdin, printing
`published <version>` after each; EOF closes the publisher. The watchdog answers rejoin requests meanwhile.
"""

from __future__ import annotations

import logging
import sys

import redis
import torch

from rlkube.core.protocol import StreamKeys
from rlkube.core.weightsync import WeightPublisher


def make_weights(version: int) -> dict[str, torch.Tensor]:
    """Deterministic per version, with several dtypes, so the receiver can check every byte."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "layer.weight": torch.randn(16, 8, generator=g),
        "layer.bias_bf16": torch.randn(8, generator=g).to(torch.bfloat16),
        "counter": torch.arange(5, dtype=torch.int64) + version,
    }


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="peer %(levelname)s %(message)s")
    addr, world, url, prefix, first = sys.argv[1:]
    client = redis.Redis.from_url(url)
    pub = WeightPublisher(client, StreamKeys(prefix), addr, int(world), timeout_s=20, watch_interval_s=0.1)
    pub.start(make_weights(int(first)).items(), version=int(first))
    print(f"published {first}", flush=True)
    for line in sys.stdin:
        v = int(line)
        pub.publish(make_weights(v).items(), version=v, step=v, documents_seen=v * 4)
        print(f"published {v}", flush=True)
    pub.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main()
