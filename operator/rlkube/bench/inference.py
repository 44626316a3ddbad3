"""`rlkube bench inference [--json]`: vLLM against the native engine on the same model and load, and what a weight
update costs per MB next to the physical limit, a raw gloo broadcast of the same bytes, measured in the same run.

Why both in one command: choosing vLLM here means knowing whether it is worth its weight (tokens/s under the
actor's kind of load: n samples per prompt, per-token log-probs) and whether its in-flight updates waste time beyond
moving the bytes, on the same model and load. Per engine it starts the real inference server process with this
process as the trainer (rlkube.bench.serve.serving), then
- tokens/s: `concurrency` clients send actor-style requests (the same prompt, n, max_tokens, log-probs) for
  `seconds`, after a warm-up of the same load; tokens are the completions' `usage.completion_tokens`;
- weight updates: `updates` publishes of the model's weights (the transfer dtype of a CPU trainer, float32):
  the trainer's blocking time (announce + transfer) and the time until /health reports the version in effect
  (transfer + checksum + load + prefix-cache reset), each per MB of the update's buffers;
- raw gloo: the same buffers (the same buckets) broadcast from this process to a second local process over a
  gloo group on 127.0.0.1, then a one-value acknowledgement back, `repeats` times: nothing but the bytes.
Needs the `core` extra; `vllm` needs vllm here or RLKUBE_VLLM_PYTHON (`make deps-vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import statistics
import time

import aiohttp
import torch
import torch.distributed as dist

from rlkube.bench.serve import SPEC, serving, timed_updates
from rlkube.core.hf import state as hf_state
from rlkube.core.weights.wire import DEFAULT_BUCKET_BYTES, pack_weights
from rlkube.local.ports import free_port

MB = 2**20
PROMPT = "12345:"


async def _tokens(url: str, body: dict, concurrency: int, seconds: float) -> dict:
    """Completion tokens/s and requests/s of `concurrency` clients sending `body` for `seconds`."""
    tokens, latencies = [0], []
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            async with session.post(url + "/v1/completions", json=body) as resp:
                reply = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {reply}")
            latencies.append(time.monotonic() - t0)
            tokens[0] += reply["usage"]["completion_tokens"]

    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    latencies.sort()
    return {"tokens_per_s": tokens[0] / wall, "requests_per_s": len(latencies) / wall,
            "p50_ms": 1000 * latencies[len(latencies) // 2], "requests": len(latencies)}


def _update_cost(pub, model, url: str, updates: int, megabytes: float) -> dict:
    publish_s, effective_s = timed_updates(pub, model, url, 1, updates)
    return {"updates": updates,
            "publish_s_median": statistics.median(publish_s),
            "in_effect_s_median": statistics.median(effective_s),
            "publish_s_per_mb": statistics.median(publish_s) / megabytes,
            "in_effect_s_per_mb": statistics.median(effective_s) / megabytes}


def _gloo_group(port: int, rank: int) -> dist.ProcessGroup:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _broadcast_all(pg: dist.ProcessGroup, buffers: list[torch.Tensor]) -> None:
    """As the weight sender does (rlkube.core.weights): every bucket issued from rank 0, then all waited for."""
    for work in [pg.broadcast(buf, 0) for buf in buffers]:
        work.wait()


def _gloo_receiver(port: int, shapes: list[tuple[int, str]], repeats: int) -> None:
    """The second process of the raw broadcast (rank 1): receives every bucket, acknowledges each round."""
    torch.set_num_threads(1)
    pg = _gloo_group(port, 1)
    buffers = [torch.empty(numel, dtype=getattr(torch, dtype)) for numel, dtype in shapes]
    ack = torch.zeros(1)
    for _ in range(repeats + 1):  # one warm-up round
        _broadcast_all(pg, buffers)
        pg.broadcast(ack, 1).wait()


def raw_gloo_broadcast(buffers: list[torch.Tensor], repeats: int) -> dict:
    """Seconds per round (all `buffers` to a second local process, and its acknowledgement), median of `repeats`."""
    port = free_port()
    shapes = [(b.numel(), str(b.dtype).removeprefix("torch.")) for b in buffers]
    child = multiprocessing.get_context("spawn").Process(target=_gloo_receiver, args=(port, shapes, repeats),
                                                         daemon=True)
    child.start()
    try:
        pg = _gloo_group(port, 0)
        ack = torch.zeros(1)
        rounds = []
        for _ in range(repeats + 1):
            t0 = time.monotonic()
            _broadcast_all(pg, buffers)
            pg.broadcast(ack, 1).wait()
            rounds.append(time.monotonic() - t0)
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    megabytes = sum(b.numel() * b.element_size() for b in buffers) / MB
    return {"repeats": repeats, "round_s_median": statistics.median(rounds[1:]),
            "s_per_mb": statistics.median(rounds[1:]) / megabytes}


def run(engines: list[str], seconds: float, concurrency: int, n: int, max_tokens: int, updates: int,
        repeats: int, model_path: str) -> dict:
    result: dict = {"model": model_path, "load": {"concurrency": concurrency, "n": n, "max_tokens": max_tokens,
                                                  "prompt": PROMPT, "seconds": seconds}, "engines": {}}
    body = {"prompt": PROMPT, "n": n, "max_tokens": max_tokens, "temperature": 1.0, "logprobs": 0}
    buffers = None
    for engine in engines:
        spec = {**SPEC, "model": {**SPEC["model"], "path": model_path},
                "algorithm": {**SPEC["algorithm"], "groupSize": n, "maxNewTokens": max_tokens},
                "inference": {**SPEC["inference"], "engine": engine}}
        with serving(spec) as (url, pub, model, timings):
            packed = pack_weights(hf_state.named_weights(model).items(), None, DEFAULT_BUCKET_BYTES)
            buffers = packed.buffers
            megabytes = sum(b.numel() * b.element_size() for b in buffers) / MB
            asyncio.run(_tokens(url, body, concurrency, min(seconds, 2.0)))  # warm-up: same load, not counted
            tokens = asyncio.run(_tokens(url, body, concurrency, seconds))
            update = _update_cost(pub, model, url, updates, megabytes)
        result["engines"][engine] = {**timings, **tokens, "weight_update": update}
        result["update_megabytes"] = megabytes
        result["model_parameters"] = sum(p.numel() for p in model.parameters())
    result["raw_gloo_broadcast"] = raw_gloo_broadcast(buffers, repeats)
    if {"native", "vllm"} <= set(result["engines"]):
        e = result["engines"]
        result["vllm_over_native_tokens_per_s"] = e["vllm"]["tokens_per_s"] / e["native"]["tokens_per_s"]
    return result


def cli(args: argparse.Namespace) -> int:
    r = run(args.engines or ["native", "vllm"], args.seconds, args.concurrency, args.n, args.max_tokens,
            args.updates, args.repeats, args.model)
    if args.json:
        print(json.dumps(r))
        return 0
    load = r["load"]
    print(f"{r['model']}: {r['model_parameters']} parameters, an update is {r['update_megabytes']:.3f} MB; load: "
          f"{load['concurrency']} clients, n={load['n']}, max_tokens={load['max_tokens']}, log-probs, "
          f"{load['seconds']:.0f}s")
    for engine, e in r["engines"].items():
        w = e["weight_update"]
        print(f"  {engine:>6}: {e['tokens_per_s']:8.1f} tokens/s ({e['requests_per_s']:.1f} requests/s, p50 "
              f"{e['p50_ms']:.0f} ms); update x{w['updates']}: trainer blocked {w['publish_s_per_mb']:.4f} s/MB, "
              f"in effect {w['in_effect_s_per_mb']:.4f} s/MB ({1000 * w['in_effect_s_median']:.1f} ms); "
              f"listening after {e['listening_s']:.1f}s")
    g = r["raw_gloo_broadcast"]
    print(f"  raw gloo broadcast of the same buffers: {g['s_per_mb']:.4f} s/MB ({1000 * g['round_s_median']:.2f} ms "
          f"per round, median of {g['repeats']})")
    if "vllm_over_native_tokens_per_s" in r:
        print(f"  vLLM / native tokens/s: {r['vllm_over_native_tokens_per_s']:.2f}")
    return 0
