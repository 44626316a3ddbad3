"""`python -m rlkube.bench.gpu_e2e [--cpu] [--out FILE]`: the real pipeline on one GPU, colocated.

Why it exists: `make gpu-smoke` (rlkube.bench.gpu_smoke) runs the training core's CUDA code in one process; it
never crosses a process boundary. This runs what a user with one GPU runs: `rlkube local` (rlkube.local.runner:
Redis, trainer, inference, preprocessor and actor as processes) on a job whose native engine is colocated with the
trainer (spec.inference.placement, docs/guide/colocated.md), a random Qwen2-0.5B-shaped model (vocabulary
151,936) in bfloat16, learning the built-in reverse-digits task from scratch. `--cpu` runs the same pipeline on a
tiny model for a few steps (float32), which tests/integration/local/test_gpu_e2e.py does so that it cannot rot.

The last stdout line is one JSON object (also written to --out): phase, steps, reward_first/last (means of the
first and last 10 steps), updates_published, updates_verified and checksums_verified (every weights_ready's
checksum equals the one the engine reports serving for that version, read from its log), samples_per_s and
train_tokens_per_s (the trainer's busy time), mfu (6 x parameters x tokens/s over the device's peak; null where the peak
is unknown), update_s and update_gb_per_s (the trainer's publish time per step, the model's bytes) beside copy_gb_per_s
(a device-to-device copy of the same bytes), peak_mem_mib of trainer and engine (nvidia-smi; null on CPU), and
baseline_samples_per_s: one process that generates and then trains the same model on the same batch
(transformers' generate, then one GRPO-shaped step), with speedup = samples_per_s / baseline_samples_per_s.
Exit status 0 only when the job Succeeded and every checksum verified.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlkube.bench.gpu_smoke import QWEN2_VOCAB, emit, write_model

log = logging.getLogger("rlkube.gpu_e2e")

# Qwen2-0.5B's shape (its config.json), with our character tokenizer; --cpu: a tiny decoder.
GPU_SIZES = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=QWEN2_VOCAB, steps=30,
                 samples=64, group=8, lr=1e-4, dtype="bfloat16")
CPU_SIZES = dict(hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, vocab=512, steps=6, samples=16,
                 group=8, lr=3e-3, dtype="float32")
MAX_NEW_TOKENS = 4
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bfloat16 peak per device name (the vendors' datasheets, without sparsity)."""
SERVED = re.compile(r"\[inference\].*weights version (\d+) in effect \(checksum ([^,]+),")


def manifest(model_dir: Path, sizes: dict[str, Any], cuda: bool) -> dict:
    return {
        "apiVersion": "rlkube.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "gpu-e2e"},
        "spec": {
            "model": {"path": str(model_dir), "dtype": sizes["dtype"], "maxSequenceLength": 32, "seed": 0},
            "task": {"name": "reverse-digits"},
            "algorithm": {"loss": "grpo", "maxSteps": sizes["steps"], "groupSize": sizes["group"],
                          "samplesPerStep": sizes["samples"], "learningRate": sizes["lr"], "maxLag": 2,
                          "maxNewTokens": MAX_NEW_TOKENS},
            "trainer": {"backend": "torch", "gpusPerNode": 1 if cuda else 0,
                        "checkpoint": {"intervalSteps": sizes["steps"]}},
            "inference": {"engine": "native", "replicas": 1, "placement": "colocated",
                          "deviceMemoryFraction": 0.3},
            "runPolicy": {"backoffLimit": 0, "completionTimeoutSeconds": 120, "eventTimeoutSeconds": 300},
        },
    }


class DeviceMemory(threading.Thread):
    """The most device memory nvidia-smi saw each role's process use (by its command line), every half second."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="device-memory")
        self.peak: dict[str, int] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.stdout.splitlines():
                pid, _, mib = (x.strip() for x in line.partition(","))
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                role = next((r for r in ("trainer", "inference") if f"rlkube.core.{r}" in cmd), None)
                if role and mib.isdigit():
                    self.peak[role] = max(self.peak.get(role, 0), int(mib))


def verified_updates(updates: list[dict[str, Any]], log_text: str) -> int:
    """How many of the trainer's announced updates the engine reports serving with the trainer's checksum."""
    from rlkube.core.weights.wire import checksums_match  # summation order may differ: the engines' own tolerance

    served = {int(v): c for v, c in SERVED.findall(log_text)}
    verified = 0
    for u in updates:
        got = served.get(int(u["version"]))
        try:
            verified += got is not None and checksums_match(float(got), float(u["checksum"]))
        except (TypeError, ValueError):
            pass
    return verified


def copy_gb_per_s(nbytes: int, device: str) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    sync()
    return round(5 * nbytes / (time.perf_counter() - t0) / 1e9, 2)


def baseline_samples_per_s(model_dir: Path, sizes: dict[str, Any], device: str, steps: int) -> float:
    """One process, one model: generate the step's samples (transformers' generate), then train on them once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkube.core.actor.tasks import BUILTIN_TASKS

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=sizes["lr"])
    task, rng = BUILTIN_TASKS["reverse-digits"](), random.Random(0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu",
                                                                                                       enabled=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    prompts_per_step = sizes["samples"] // sizes["group"]
    t0 = None
    for step in range(steps + 1):  # the first step warms up
        if step == 1:
            sync()
            t0 = time.perf_counter()
        prompts = [task.prompt(rng) for _ in range(prompts_per_step)]
        ids = [tok(p.text)["input_ids"] for p in prompts for _ in range(sizes["group"])]
        width = max(map(len, ids))
        pad = tok.pad_token_id
        batch = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=device)
        mask = (batch != pad).long()
        model.eval()
        with torch.no_grad(), autocast:
            out = model.generate(input_ids=batch, attention_mask=mask, do_sample=True,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=pad)
        completions = tok.batch_decode(out[:, width:], skip_special_tokens=True)
        rewards = torch.tensor([task.reward(prompts[i // sizes["group"]], c) for i, c in enumerate(completions)],
                               device=device)
        adv = (rewards.view(-1, sizes["group"]) - rewards.view(-1, sizes["group"]).mean(1, keepdim=True)).view(-1)
        model.train()
        full_mask = torch.cat([mask, (out[:, width:] != pad).long()], dim=1)
        with autocast:
            logits = model(input_ids=out, attention_mask=full_mask).logits[:, width - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, out[:, width:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp * full_mask[:, width:]).sum() / full_mask[:, width:].sum().clamp(min=1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sync()
    return steps * sizes["samples"] / (time.perf_counter() - t0)


def run(args: argparse.Namespace, work: Path, result: dict[str, Any]) -> None:
    import torch
    from rich.console import Console

    from rlkube.local.runner import run_local

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --cpu)")
    sizes = {**(CPU_SIZES if args.cpu else GPU_SIZES), **({"steps": args.steps} if args.steps else {})}
    device = "cuda" if cuda else "cpu"
    result["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    model_dir = write_model(work / "model", sizes["vocab"], sizes, seed=0)
    import safetensors

    with safetensors.safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    nbytes = params * (2 if sizes["dtype"] == "bfloat16" else 4)
    result.update(params=params, dtype=sizes["dtype"], vocab=sizes["vocab"], samples_per_step=sizes["samples"])

    memory = DeviceMemory()
    if cuda:
        memory.start()
    t0 = time.monotonic()
    job = run_local(manifest(model_dir, sizes, cuda), work / "run", Console(stderr=True), work / "cache")
    memory.stop.set()
    result.update(phase=job.phase, reason=job.reason, message=job.message, steps=job.steps,
                  job_wall_s=round(time.monotonic() - t0, 1),
                  reward_first=job.reward_window(first=True), reward_last=job.reward_window(first=False))
    log_path = work / "run" / "logs" / "trainer-0.log"
    log_text = log_path.read_text(errors="replace") if log_path.exists() else ""
    result["updates_published"] = len(job.updates)
    result["updates_verified"] = verified_updates(job.updates, log_text)
    result["checksums_verified"] = 0 < result["updates_verified"] == result["updates_published"]

    m = [x for x in job.metrics if "step" in x]
    if len(m) >= 2:
        result["samples_per_s"] = round((len(m) - 1) * sizes["samples"] / (m[-1]["_t"] - m[0]["_t"]), 2)
    busy = sum(x.get("busy_s") or 0 for x in m)
    tokens = sum(x.get("tokens") or 0 for x in m)
    result["train_tokens_per_s"] = round(tokens / busy, 1) if busy else None
    peak = next((v for k, v in PEAK_FLOPS.items() if k in result["device"]), None) if cuda else None
    result["mfu"] = round(6 * params * result["train_tokens_per_s"] / peak, 4) if peak and busy else None
    publish = [x["publish_s"] for x in m[1:] if x.get("publish_s")]
    result["update_s"] = round(sum(publish) / len(publish), 3) if publish else None
    result["update_gb_per_s"] = round(nbytes / result["update_s"] / 1e9, 4) if result["update_s"] else None
    result["update_bytes"] = nbytes
    result["copy_gb_per_s"] = copy_gb_per_s(nbytes, device)
    result["peak_mem_mib"] = {"trainer": memory.peak.get("trainer"), "engine": memory.peak.get("inference")} \
        if cuda else None
    baseline = baseline_samples_per_s(model_dir, sizes, device, steps=min(5, sizes["steps"]))
    result["baseline_samples_per_s"] = round(baseline, 2)
    sps = result.get("samples_per_s")
    result["speedup"] = round(sps / baseline, 2) if sps else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlkube.bench.gpu_e2e", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="a tiny model on CPU, a few steps (the test tier)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    p.add_argument("--steps", type=int, help="training steps (default 30; 6 with --cpu)")
    p.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temp directory)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s gpu-e2e %(levelname)s %(message)s")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    result: dict[str, Any] = {"ok": False}
    try:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            run(args, args.keep, result)
        else:
            with tempfile.TemporaryDirectory(prefix="rlkube-gpu-e2e-") as tmp:
                run(args, Path(tmp), result)
        result["ok"] = result.get("phase") == "Succeeded" and bool(result.get("checksums_verified"))
    except BaseException as exc:  # noqa: BLE001 - reported in the JSON line, and the exit status says so
        log.exception("gpu-e2e failed")
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["wall_s"] = round(time.monotonic() - started, 1)
    return emit(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
