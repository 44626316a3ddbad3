"""Stands in for `fast-llm train gpt` under torchrun (not a test): it makes the Redis and torch.distributed calls
Fast-LLM makes, with Fast-LLM's arguments and in Fast-LLM's order, and nothing else (Fast-LLM itself needs Python
3.12 and CUDA to train). Line numbers are Fast-LLM's at the commit tests/fixtures/fast_llm_config_fields.json
records (d3d20226).

`python fast_llm_stand_in.py CONFIG_YAML RENDEZVOUS_TIMEOUT_S [--model DIR] [--steps N] [--overshoot K]`, or as
Fast-LLM's own command line, `fast_llm_stand_in.py train gpt --config CONFIG_YAML [--overshoot K] [--timeout-s S]`
(both also take `--pause-after-step K`)
(what a trainer pod's torchrun runs as `fast-llm`: the model is the config's `pretrained.path`, the steps its
`training.train_iters`; tests/e2e/node_agent/test_fast_llm_job.py), reading from the config the same fields Fast-LLM
reads:
- the streaming callback's constructor (fast_llm/engine/training/streaming.py:40-55, rank 0): `redis.Redis(host,
  port)` (RedisConfig.get_client), then the broadcast group: ProcessGroupPool(rank=0, world_size=
  external_world_size + 1) = `torch.distributed.rendezvous("tcp://{host}:{port}", 0, world_size)`
  (fast_llm/engine/distributed/distributed.py:65-72) and `get_process_group(range(world_size), 0)` = the
  backend's process group on `PrefixStore("range_0_{world_size}_1/", store)` (distributed.py:112-122);
- run_begin (streaming.py:57-59): one update at step 0 with documents_seen 0;
- the streaming dataset (fast_llm/data/dataset/streaming.py): XGROUP CREATE fast_llm_group mkstream, then
  XREADGROUP count 1 block 1000 noack as `fast_llm_consumer_{rank}`, one document at a time; each step reads
  docs_per_step + overshoot documents (Fast-LLM fills its last micro-batch past docs_per_step);
- step_end (streaming.py:61-74): one update per step with the step and the true documents_seen;
- an update (streaming.py:97-119): XADD `weights_ready` to fast_llm_events, then per exported tensor
  broadcast_object((shard_name, layer_name, shape, dtype)) and broadcast(tensor), then broadcast_object(None);
  the framing below follows Fast-LLM's broadcast helpers (fast_llm/core/distributed.py:50-64,
  163-198, 295-302), pickle included;
- train_end (streaming.py:82-86): XADD `training_finished` ({"type"} only);
- checkpoints (fast_llm/engine/training/trainer.py): with `run.experiment_dir` and `training.checkpoint.interval`
  set, `{experiment_dir}/checkpoint/{step}` every interval steps, and at start the newest one is resumed from
  (its completed_steps and documents_seen; run_begin announces that step). `--pause-after-step K` (a run that
  resumed from no checkpoint only) holds it after step K, between updates, for a test to kill it there.
The weights: with --model, the HF checkpoint's tensors under their HF names, in its dtype, the tied output
weight left out as Fast-LLM's export does, each moved by `step x 1e-3` so every update differs; without, one
2x3 float32 tensor. Prints `stand-in: <what>` lines (`stand-in: checksum <step> <value>`: weights_checksum of an
update); exits 0 when all of it worked, 3 when the broadcast rendezvous timed out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import sys
import threading

import redis
import torch
import torch.distributed as dist
import yaml

WEIGHTS_SHARD = "weights"


# --- the sender's side of the wire, written here after Fast-LLM's fast_llm/core/distributed.py ----------------

def send(group, tensor: torch.Tensor) -> None:
    """One collective broadcast from rank 0, first tensor of the list (distributed.py:50-64 sets the same
    rootRank/rootTensor options)."""
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    group.broadcast([tensor], options).wait()


def send_pickled(group, value) -> None:
    """An object as Fast-LLM's broadcast_object frames it (distributed.py:179-198, 295-302): its pickle's length
    as a one-element int64 tensor, then the pickle as a uint8 tensor. Gloo keeps both on the CPU; NCCL would
    want them on the current CUDA device (distributed.py:30-36), which this CPU stand-in never uses."""
    payload = pickle.dumps(value)
    send(group, torch.tensor([len(payload)], dtype=torch.int64))
    send(group, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def broadcast_group(host: str, port: int, external_world_size: int, backend: str, timeout: datetime.timedelta):
    """streaming.py:42-54 with ProcessGroupPool (distributed.py:65-72, 112-122) for rank 0."""
    world_size = external_world_size + 1
    store, _, _ = next(dist.rendezvous(f"tcp://{host}:{port}", 0, world_size, timeout=timeout))
    ranks = range(world_size)
    prefix = f"range_{ranks.start}_{ranks.stop}_{ranks.step}/"
    group_class = dist.ProcessGroupNCCL if backend == "nccl" else dist.ProcessGroupGloo
    return group_class(dist.PrefixStore(prefix, store), 0, world_size, timeout)


def broadcast_weights(client, group, step: int, documents_seen: int, tensors) -> None:
    """streaming.py:97-119 on rank 0."""
    client.xadd("fast_llm_events",
                {"event": json.dumps({"type": "weights_ready", "step": step, "documents_seen": documents_seen})})
    for shard_name, layer_name, tensor in tensors:
        send_pickled(group, (shard_name, layer_name, tensor.shape, tensor.dtype))
        send(group, tensor.contiguous())
    send_pickled(group, None)


# --- the weights and the documents --------------------------------------------------------------------------

def model_weights(model_dir: str | None) -> dict[str, torch.Tensor]:
    if model_dir is None:
        return {"model.layers.0.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="auto")
    state = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # fast_llm/models/gpt/conversion/llama.py:421-427
    return {k: v.detach().clone() for k, v in state.items()}


def checksum(named: dict[str, torch.Tensor]) -> float:
    from rlkube.core.weights.wire import weights_checksum

    return weights_checksum(sorted(named.items()))


def read_documents(client, rank: int, n: int) -> list[list[int]]:
    docs = []
    while len(docs) < n:
        messages = client.xreadgroup(groupname="fast_llm_group", consumername=f"fast_llm_consumer_{rank}",
                                     streams={"fast_llm_streaming": ">"}, count=1, block=1000, noack=True)
        for _, entries in messages or []:
            for _, fields in entries:
                docs.append(torch.frombuffer(bytearray(fields[b"tokens"]), dtype=torch.int64).tolist())
    return docs


def save_checkpoint(experiment_dir: str, step: int, documents_seen: int) -> None:
    """`{experiment_dir}/checkpoint/{step}` with the counters Fast-LLM's checkpoint metadata holds
    (fast_llm/engine/training/trainer.py: completed_steps, documents_seen), written to a temporary name first."""
    root = os.path.join(experiment_dir, "checkpoint")
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".{step}.tmp")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "metadata.yaml"), "w") as f:
        yaml.safe_dump({"completed_steps": step, "documents_seen": documents_seen}, f)
    os.replace(tmp, os.path.join(root, str(step)))
    print(f"stand-in: checkpoint {step}", flush=True)


def resume(experiment_dir: str | None) -> tuple[int, int]:
    """(completed_steps, documents_seen) of the newest checkpoint (trainer.py: `_get_last_checkpoint`, then
    `_load_checkpoint`), (0, 0) without one."""
    root = os.path.join(experiment_dir, "checkpoint") if experiment_dir else None
    steps = [int(n) for n in os.listdir(root) if n.isdigit()] if root and os.path.isdir(root) else []
    if not steps:
        return 0, 0
    with open(os.path.join(root, str(max(steps)), "metadata.yaml")) as f:
        meta = yaml.safe_load(f)
    print(f"stand-in: resumed from checkpoint {meta['completed_steps']} ({meta['documents_seen']} documents seen)",
          flush=True)
    return meta["completed_steps"], meta["documents_seen"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:2] == ["train", "gpt"]:  # `fast-llm train gpt --config FILE`, as the trainer pod runs Fast-LLM
        cli = argparse.ArgumentParser(prog="fast-llm train gpt")
        cli.add_argument("--config", required=True)
        cli.add_argument("--overshoot", type=int, default=0)
        cli.add_argument("--timeout-s", type=float, default=600.0)
        cli.add_argument("--pause-after-step", type=int, default=None)
        args = cli.parse_args(argv[2:])
        config = yaml.safe_load(open(args.config))
        return argparse.Namespace(config=args.config, timeout_s=args.timeout_s, model=config["pretrained"]["path"],
                                  steps=config["training"]["train_iters"], overshoot=args.overshoot,
                                  pause_after_step=args.pause_after_step)
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("timeout_s", type=float)
    parser.add_argument("--model")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--overshoot", type=int, default=0)
    parser.add_argument("--pause-after-step", type=int, default=None)
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args(sys.argv[1:])
    config = yaml.safe_load(open(args.config))
    timeout = datetime.timedelta(seconds=args.timeout_s)
    rank = int(os.environ["RANK"])
    print(f"stand-in: rank {rank} agent store {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')} "
          f"password in env {'REDIS_PASSWORD' in os.environ}", flush=True)

    callback = config["callbacks"]["streaming"]
    events = redis.Redis(callback["host"], callback["port"])
    bc = callback["broadcast"]
    backend = bc["backend"]
    if backend == "nccl" and not torch.cuda.is_available():
        # A GPU job's config (vLLM servers receive over NCCL) run on CPUs: gloo, as a CPU vLLM worker joins.
        print("stand-in: backend nccl without CUDA: broadcasting over gloo", flush=True)
        backend = "gloo"
    try:
        group = broadcast_group(bc["host"], bc["port"], bc["external_world_size"], backend, timeout)
    except Exception as exc:  # torch raises DistStoreError / DistNetworkError / TimeoutError by version
        print(f"stand-in: broadcast rendezvous failed: {type(exc).__name__}", flush=True)
        return 3
    print("stand-in: broadcast group formed", flush=True)
    base = model_weights(args.model)

    def update(step: int, seen: int) -> None:
        named = {k: (v + step * 1e-3).to(v.dtype) if v.is_floating_point() and step else v for k, v in base.items()}
        broadcast_weights(events, group, step, seen, ((WEIGHTS_SHARD, k, v) for k, v in named.items()))
        print(f"stand-in: checksum {step} {checksum(named)!r}", flush=True)

    experiment = config.get("run", {}).get("experiment_dir")
    interval = config.get("training", {}).get("checkpoint", {}).get("interval")
    completed, seen = resume(experiment)
    update(completed, seen)  # run_begin(completed_steps, documents_seen)

    data = config["data"]["datasets"]["training"]
    client = redis.Redis(host=data["host"], port=data["port"])
    try:
        client.xgroup_create(name="fast_llm_streaming", groupname="fast_llm_group", id="0", mkstream=True)
    except redis.exceptions.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise
    if args.steps == 0:
        print(f"stand-in: document {read_documents(client, rank, 1)[0]}", flush=True)
    per_step = config["schedule"]["docs_per_step"] + args.overshoot
    for step in range(completed + 1, args.steps + 1):
        seen += len(read_documents(client, rank, per_step))
        print(f"stand-in: trained step {step} ({seen} documents seen)", flush=True)
        update(step, seen)  # step_end
        if experiment and interval and step % interval == 0:
            save_checkpoint(experiment, step, seen)
        if step == args.pause_after_step and completed == 0:
            # Held where Fast-LLM waits for the next step's documents, for a test to kill it between updates.
            print(f"stand-in: paused after step {step}", flush=True)
            threading.Event().wait()
    events.xadd("fast_llm_events", {"event": json.dumps({"type": "training_finished"})})
    print("stand-in: broadcast done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
