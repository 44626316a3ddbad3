"""Stands in for `fast-llm train gpt` under torchrun in the launcher test (not a test): it makes the Redis and
torch.distributed calls Fast-LLM makes, with Fast-LLM's arguments, and nothing else (Fast-LLM itself needs
Python 3.12 and CUDA).

`python fast_llm_stand_in.py CONFIG_YAML RENDEZVOUS_TIMEOUT_S`, reading from the config the same fields Fast-LLM
reads:
- the streaming dataset (fast_llm/data/dataset/streaming.py): `redis.Redis(host=, port=)`, XGROUP CREATE
  fast_llm_group mkstream, then XREADGROUP count 1 block 1000 noack as `fast_llm_consumer_{rank}`, one document;
- the streaming callback (fast_llm/engine/training/streaming.py, rank 0): `redis.Redis(host, port)` (RedisConfig
  .get_client), XADD a `weights_ready` event to fast_llm_events, then the broadcast group:
  `torch.distributed.rendezvous("tcp://{host}:{port}", 0, external_world_size + 1)` and a process group on
  `PrefixStore("range_0_{n}_1/", store)` (ProcessGroupPool), here gloo; broadcast metadata then a tensor,
  then a `None` sentinel, each object framed as broadcast_object frames it (an int64 size, then uint8 bytes; JSON
  here where Fast-LLM pickles), and XADD `training_finished`.
Prints `stand-in: <step>` lines; exits 0 when all of it worked, 3 when the broadcast rendezvous timed out.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import redis
import torch
import torch.distributed as dist
import yaml


def main() -> int:
    config = yaml.safe_load(open(sys.argv[1]))
    timeout = datetime.timedelta(seconds=float(sys.argv[2]))
    rank = int(os.environ["RANK"])
    print(f"stand-in: rank {rank} agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')} "
          f"password in env {'REDIS_PASSWORD' in os.environ}", flush=True)

    data = config["data"]["datasets"]["training"]
    client = redis.Redis(host=data["host"], port=data["port"])
    try:
        client.xgroup_create(name="fast_llm_streaming", groupname="fast_llm_group", id="0", mkstream=True)
    except redis.exceptions.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    messages = client.xreadgroup(groupname="fast_llm_group", consumername=f"fast_llm_consumer_{rank}",
                                 streams={"fast_llm_streaming": ">"}, count=1, block=1000, noack=True)
    (_, entries), = messages
    tokens = torch.frombuffer(bytearray(entries[0][1][b"tokens"]), dtype=torch.int64)
    print(f"stand-in: document {tokens.tolist()}", flush=True)

    callback = config["callbacks"]["streaming"]
    events = redis.Redis(callback["host"], callback["port"])
    events.xadd("fast_llm_events", {"event": json.dumps({"type": "weights_ready", "step": 0, "documents_seen": 0})})
    broadcast = callback["broadcast"]
    world = broadcast["external_world_size"] + 1
    try:
        store, _, _ = next(dist.rendezvous(f"tcp://{broadcast['host']}:{broadcast['port']}", 0, world,
                                           timeout=timeout))
    except Exception as exc:  # torch raises DistStoreError / DistNetworkError / TimeoutError by version
        print(f"stand-in: broadcast rendezvous failed: {type(exc).__name__}", flush=True)
        return 3
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"range_0_{world}_1/", store), 0, world, timeout)
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for obj in (["model.layers.0.weight", list(weight.shape), "float32"], None):
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        group.broadcast([torch.tensor([payload.numel()])], dist.BroadcastOptions()).wait()
        group.broadcast([payload], dist.BroadcastOptions()).wait()
        if obj is not None:
            group.broadcast([weight], dist.BroadcastOptions()).wait()
    events.xadd("fast_llm_events", {"event": json.dumps({"type": "training_finished"})})
    print("stand-in: broadcast done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
