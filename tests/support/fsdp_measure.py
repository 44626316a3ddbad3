"""Per-rank memory and step time of the torch trainer unsharded (world 1) vs FSDP2 (world N) on one model, for the
notes (run by hand; not a test):

    PYTHONPATH=operator:tests python tests/support/fsdp_measure.py --world 2

Writes a wider built-in Llama (`--hidden`, `--layers`), then runs `--world` trainer ranks (one process each, gloo;
world 1: the unsharded backend in one process), each training `--steps` steps on its share of `--per-step`
documents after one warm-up step, and prints per rank: parameter, gradient and Adam bytes it holds (torch-tracked,
at their peak: just before the optimizer step), resident memory (after loading the libraries, after training,
and the process's peak), and the mean step time."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlkube.local.ports import free_port


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def trimmed_rss_mb() -> float:
    """Resident memory once glibc returned its free heap pages to the system (malloc_trim): what the process
    still uses, rather than what its allocator kept after transient buffers were freed."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_mb()


def write_model(directory: Path, hidden: int, layers: int) -> None:
    import torch
    from rlkube.core.hf.builtin import char_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    tokenizer = char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 4 * hidden, layers
    config.num_attention_heads = config.num_key_value_heads = hidden // 32
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def rank_main(args) -> None:
    import torch
    from support.core_roles import make_documents, tiny_spec
    from rlkube.lifecycle.validation import parse_spec
    from rlkube.core.trainer import Trainer

    base = rss_mb()
    world = args.world
    spec = tiny_spec(maxSteps=100, samplesPerStep=args.per_step)
    spec["model"]["path"] = args.model
    if world > 1:
        spec["trainer"].update(sharding="fsdp", processesPerNode=world)
    dp = None
    if world > 1:
        from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
        dp = DataParallel(DistConfig.from_env())
    rank = dp.rank if dp else 0
    trainer = Trainer(parse_spec(spec), dp=dp, model_dir=Path(args.model))
    loaded = rss_mb()
    docs = make_documents((args.steps + 1) * args.per_step, seed=1)
    backend = trainer.backend
    held = {}

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    original = backend.optim_step

    def measured_step():  # the peak of parameter + gradient + Adam bytes: gradients exist until zero_grad
        params = [local(p) for p in backend.model.parameters()]
        held["parameters"] = sum(p.numel() * p.element_size() for p in params)
        held["gradients"] = sum(local(p.grad).numel() * local(p.grad).element_size()
                                for p in backend.model.parameters() if p.grad is not None)
        held["optimizer"] = sum(local(v).numel() * local(v).element_size() for s in backend.optimizer.state.values()
                                for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return original()

    backend.optim_step = measured_step
    times = []
    for k in range(args.steps + 1):
        step_docs = docs[k * args.per_step:(k + 1) * args.per_step][rank::world]
        t0 = time.perf_counter()
        trainer.train_step(step_docs)
        times.append(time.perf_counter() - t0)
    report = {"world": world, "rank": rank, **{f"{k}_mb": v / 2**20 for k, v in held.items()},
              "tracked_mb": sum(held.values()) / 2**20, "rss_libraries_mb": base, "rss_loaded_mb": loaded,
              "rss_trained_mb": rss_mb(), "rss_trimmed_mb": trimmed_rss_mb(), "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "step_s": sum(times[1:]) / args.steps}
    print(json.dumps(report), flush=True)
    if dp is not None:
        dp.finish()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--per-step", type=int, default=16)
    ap.add_argument("--model")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        return rank_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        model.mkdir()
        write_model(model, args.hidden, args.layers)
        port = free_port()
        cmd = [sys.executable, __file__, "--rank", "--world", str(args.world), "--steps", str(args.steps),
               "--per-step", str(args.per_step), "--model", str(model)]
        procs = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.world),
                                            "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
                 for r in range(args.world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"ranks exited {codes}")


if __name__ == "__main__":
    main()
