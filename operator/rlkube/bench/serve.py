"""`rlkube bench serve [--engine native|vllm] [--json]`: the serving side (inference + weight updates); prints
numbers only.

Starts a private Redis and a real inference server process (engine `native`, or `vllm`: then RLKUBE_VLLM_PYTHON or
an interpreter with vllm, see rlkube.core.inference.vllm_engine) for the tiny model, joins it from this
process as the trainer (WeightPublisher), then measures
- HTTP completions/s (n=8, max_tokens=4) at several client concurrencies, with latency percentiles;
- weight updates: the trainer's blocking time per publish (announce + transfer) and the time until the server
  reports the new version in effect (transfer + load + swap), over repeated updates, with the server idle and
  while it generates flat out (as in a pipelined run).
Needs the `core` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import aiohttp

from rlkube.contract import runtime
from rlkube.contract.protocol import StreamKeys
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import load_model
from rlkube.core.hf.source import materialize_model
from rlkube.core.weights.publication import WeightPublisher
from rlkube.lifecycle.validation import parse_spec
from rlkube.local.ports import free_port
from rlkube.local.redis_server import RedisServer

SPEC = {
    "model": {"path": "builtin://tiny-llama", "maxSequenceLength": 32},
    "algorithm": {"maxSteps": 1, "groupSize": 8, "maxNewTokens": 4},
    "inference": {"engine": "native", "replicas": 1},
}


async def _load(url: str, concurrency: int, seconds: float, stop: threading.Event | None = None) -> dict:
    latencies: list[float] = []
    body = {"prompt": "12345:", "n": 8, "max_tokens": 4, "temperature": 1.0, "logprobs": 0}
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            t0 = time.monotonic()
            async with session.post(url + "/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
            latencies.append(time.monotonic() - t0)

    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
        wall = time.monotonic() - t0
    latencies.sort()
    return {
        "concurrency": concurrency,
        "requests_per_s": len(latencies) / wall,
        "samples_per_s": 8 * len(latencies) / wall,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p95_ms": 1000 * latencies[int(len(latencies) * 0.95)],
    }


def _health(url: str) -> dict:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return json.loads(resp.read())
    except Exception:  # noqa: BLE001 - not up yet (503 raises too)
        return {}


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except Exception:  # noqa: BLE001 - not up yet
        return False


@contextlib.contextmanager
def serving(spec: dict, publisher: dict | None = None):
    """A private Redis, an inference server process for `spec` and this process as its trainer (a WeightPublisher
    that sent the model's initial weights): yields (url, publisher, model, timings); stops them all."""
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp) / "redis") as redis_server:
        config = runtime.write_job_config(Path(tmp) / "job.json", "bench", "serve", spec)
        port, sync_port = free_port(), free_port()
        env = {**os.environ, runtime.ENV_CONFIG: str(config), runtime.ENV_REDIS_URL: redis_server.url,
               runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{sync_port}", runtime.ENV_PORT: str(port)}
        with open(Path(tmp) / "inference.log", "wb") as log:
            server = subprocess.Popen([sys.executable, "-m", "rlkube.core.inference"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        pub = None
        try:
            parsed = parse_spec(spec)
            model = load_model(materialize_model(parsed.model))
            # vLLM takes ~30-170 s to listen on 2 cores: longer than the group's rendezvous timeout, so the trainer
            # side starts once the server answers HTTP (its /health stays 503 until it joined and warmed up).
            while not _answers(url + "/v1/models"):
                if server.poll() is not None:
                    raise RuntimeError(f"inference exited: {(Path(tmp) / 'inference.log').read_text()}")
                time.sleep(0.1)
            listening_s = time.monotonic() - started
            pub = WeightPublisher(redis_server.client(), StreamKeys.for_job("bench", "serve"),
                                  f"127.0.0.1:{sync_port}", runtime.weight_sync_world_size(parsed), timeout_s=60,
                                  **(publisher or {}))
            t0 = time.monotonic()
            starter = threading.Thread(target=pub.start, args=(list(hf_state.named_weights(model).items()),),
                                       daemon=True)
            starter.start()
            while _health(url).get("status") != "ok":
                if server.poll() is not None:
                    raise RuntimeError(f"inference exited: {(Path(tmp) / 'inference.log').read_text()}")
                time.sleep(0.02)
            starter.join()
            yield url, pub, model, {"listening_s": listening_s, "startup_join_s": time.monotonic() - t0}
        finally:
            if pub is not None:
                pub.close()
            server.terminate()
            server.wait(timeout=30)


def run(seconds: float, updates: int, engine: str = "native") -> dict:
    spec = {**SPEC, "inference": {**SPEC["inference"], "engine": engine}}
    with serving(spec) as (url, pub, model, timings):
        serving_ = [asyncio.run(_load(url, c, seconds)) for c in (1, 4, 16)]
        params = sum(p.numel() for p in model.parameters())
        idle = _updates(pub, model, url, 1, updates)
        # The same while the server generates flat out (4 concurrent clients), as in a pipelined run.
        stop = threading.Event()
        loader = threading.Thread(target=lambda: asyncio.run(_load(url, 4, 3600, stop)), daemon=True)
        loader.start()
        busy = _updates(pub, model, url, updates + 1, updates)
        stop.set()
        loader.join()
    return {
        "engine": engine,
        "listening_s": timings["listening_s"],
        "model_parameters": params,
        "startup_join_s": timings["startup_join_s"],
        "serving": serving_,
        "weight_update_idle": idle,
        "weight_update_serving": busy,
    }


def timed_updates(pub: WeightPublisher, model, url: str, first: int, count: int) -> tuple[list[float], list[float]]:
    """Publish versions first..first+count-1 of `model`'s weights: (seconds the publisher blocked, seconds until
    the server's /health reported each version in effect)."""
    publish_s, effective_s = [], []
    for v in range(first, first + count):
        t0 = time.monotonic()
        pub.publish(hf_state.named_weights(model).items(), version=v, step=v)
        publish_s.append(time.monotonic() - t0)
        while _health(url).get("model_version") != v:
            time.sleep(0.001)
        effective_s.append(time.monotonic() - t0)
    return publish_s, effective_s


def _updates(pub: WeightPublisher, model, url: str, first: int, count: int) -> dict:
    publish_s, effective_s = timed_updates(pub, model, url, first, count)
    return {
        "updates": count,
        "publish_ms_median": 1000 * statistics.median(publish_s),
        "publish_ms_max": 1000 * max(publish_s),
        "in_effect_ms_median": 1000 * statistics.median(effective_s),
        "in_effect_ms_max": 1000 * max(effective_s),
    }


def cli(args: argparse.Namespace) -> int:
    result = run(args.seconds, args.updates, args.engine)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"engine {result['engine']}, tiny model: {result['model_parameters']} parameters; listening after "
          f"{result['listening_s']:.1f}s; first join + transfer (+ warm-up) {result['startup_join_s']:.2f}s")
    for s in result["serving"]:
        print(f"  concurrency {s['concurrency']:>2}: {s['requests_per_s']:7.1f} completions/s (n=8, max_tokens=4), "
              f"{s['samples_per_s']:7.1f} samples/s, p50 {s['p50_ms']:.1f} ms, p95 {s['p95_ms']:.1f} ms")
    for label, key in (("idle server", "weight_update_idle"), ("server generating", "weight_update_serving")):
        w = result[key]
        print(f"  weight update x{w['updates']} ({label}): trainer blocked {w['publish_ms_median']:.1f} ms median "
              f"({w['publish_ms_max']:.1f} max); in effect after {w['in_effect_ms_median']:.1f} ms median "
              f"({w['in_effect_ms_max']:.1f} max)")
    return 0
