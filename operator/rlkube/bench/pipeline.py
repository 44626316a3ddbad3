"""`rlkube bench pipeline`: the same job run pipelined and synchronously, side by side on this machine.

(a) pipelined: the manifest as given (actors run up to maxLag weight versions ahead of the trainer);
(b) synchronous: the same task, model and sample count with maxLag 0, so the actors generate one step's batch
with the current weights and wait for the trainer to train on it: generate, train, generate, train.
Throughput is measured between the first and the last optimizer step (Redis stream-id timestamps of the
trainer's `metrics` events), which leaves process start-up out of both numbers.
The job is `--manifest FILE`, by default TINY_JOB below: examples/tiny-cpu.yaml, written here so the benchmark
runs from an installed package, with no repository beside it. Needs the `core` extra.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from rlkube.api.spec import GROUP, KIND, VERSION
from rlkube.local.runner import RunResult, run_local

# examples/tiny-cpu.yaml (tests/unit/test_bench_jobs.py keeps them equal): a randomly initialised tiny model
# learning the built-in task on one CPU.
TINY_JOB = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": KIND,
    "metadata": {"name": "bench"},
    "spec": {
        "image": "ghcr.io/rlkube/core:0.1.0",
        "model": {"path": "builtin://tiny-llama", "seed": 0, "maxSequenceLength": 32},
        "task": {"name": "reverse-digits"},
        "algorithm": {"loss": "grpo", "maxSteps": 40, "groupSize": 8, "samplesPerStep": 32,
                      "learningRate": 0.003, "maxLag": 2, "maxNewTokens": 4},
        "trainer": {"backend": "torch", "checkpoint": {"intervalSteps": 10},
                    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        "inference": {"engine": "native", "replicas": 1, "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
        "actor": {"replicas": 1},
        "preprocessor": {"replicas": 1},
        "redis": {"mode": "managed"},
        "runPolicy": {"backoffLimit": 2, "completionTimeoutSeconds": 60, "eventTimeoutSeconds": 300},
        "teardown": {"gracePeriodSeconds": {"actor": 10, "preprocessor": 10, "inference": 10, "trainer": 30,
                                            "redis": 10}},
    },
}


def steady_throughput(result: RunResult, samples_per_step: int) -> tuple[float, float]:
    """(samples/s, trainer busy fraction) over steps 2..N."""
    steps = [m for m in result.metrics if "_t" in m]
    if len(steps) < 2:
        raise RuntimeError(f"{result.name}: too few steps to measure ({result.phase}: {result.message})")
    span = steps[-1]["_t"] - steps[0]["_t"]
    samples = samples_per_step * (len(steps) - 1)
    busy = sum(float(m.get("busy_s", 0.0)) for m in steps[1:])
    return samples / span, min(1.0, busy / span)


def run_pair(manifest: dict, samples: int | None, console: Console) -> dict[str, Any]:
    per_step = manifest["spec"]["algorithm"].get("samplesPerStep", 32)
    if samples:
        manifest["spec"]["algorithm"]["maxSteps"] = max(3, samples // per_step)
    pipelined = copy.deepcopy(manifest)
    pipelined["spec"]["algorithm"]["maxLag"] = max(1, manifest["spec"]["algorithm"].get("maxLag", 2))
    sync = copy.deepcopy(manifest)
    sync["spec"]["algorithm"]["maxLag"] = 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlkube-bench-") as tmp:
        for mode, doc in (("pipelined", pipelined), ("sync", sync)):
            doc["metadata"]["name"] = f"bench-{mode}"
            console.print(f"[bold]bench pipeline[/bold]: {mode} (maxLag {doc['spec']['algorithm']['maxLag']})")
            result = run_local(doc, Path(tmp) / mode, console)
            if result.phase != "Succeeded":
                raise RuntimeError(f"{mode} run ended {result.phase}: {result.reason} {result.message}")
            results[mode] = result
    p_sps, p_busy = steady_throughput(results["pipelined"], per_step)
    s_sps, s_busy = steady_throughput(results["sync"], per_step)
    return {
        "samples": per_step * manifest["spec"]["algorithm"]["maxSteps"],
        "pipelined_sps": round(p_sps, 3),
        "sync_sps": round(s_sps, 3),
        "ratio": round(p_sps / s_sps, 3),
        "trainer_busy": round(p_busy, 3),
        "sync_trainer_busy": round(s_busy, 3),
        "pipelined_reward_last": results["pipelined"].reward_window(first=False),
        "sync_reward_last": results["sync"].reward_window(first=False),
    }


def cli(args) -> int:
    console = Console(stderr=True)
    if args.manifest:
        manifest = yaml.safe_load(Path(args.manifest).read_text())
    else:
        manifest = copy.deepcopy(TINY_JOB)
    out = run_pair(manifest, args.samples, console)
    console.print(
        f"pipelined {out['pipelined_sps']} samples/s, synchronous {out['sync_sps']} samples/s, "
        f"ratio {out['ratio']}x, trainer busy {out['trainer_busy']:.0%} (pipelined) vs "
        f"{out['sync_trainer_busy']:.0%} (sync)"
    )
    if args.json:
        sys.stdout.write(json.dumps(out) + "\n")
    return 0
