"""`rlkube bench weight-receive`: the extra peak memory of an inference server's receiver during ONE weight update
of a random Qwen2-shaped model (Qwen2-0.5B's shape by default), today's receive (every bucket allocated, then the
model loaded: `WeightReceiver.receive`) beside the streamed one (each bucket copied into the model's parameters as
it arrives, one reused bucket buffer: `WeightReceiver.receive_streamed`, what the native engine does).

Why a benchmark: memory depends on the machine's allocator; tests/integration/weights/test_weight_receive_memory.py
asserts the bound on a smaller model through the same `measure`.

How: this process is the trainer (a WeightSender over gloo on loopback, the weights random in the transfer dtype);
each variant's receiver is a FRESH subprocess holding the served model (built on the meta device, then
materialized and zeroed, so every page is resident before the update). The receiver resets its peak RSS
(/proc/self/clear_refs: 5), receives one update, and reports VmHWM minus its RSS before the update: what the
update added at its peak. A tensor larger than a bucket travels alone, so the default bucket is the smallest
multiple of 32 MiB that holds the largest tensor (the embedding).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time

VARIANTS = ("today", "streamed")
MIB = 2**20


def qwen2_config(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       tie_word_embeddings=True, max_position_embeddings=512)


def _served_model(config, dtype):
    """The served model, every parameter resident (zeroed: the update writes every value)."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(dtype)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gave the tied head a tensor of its own
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def run_receiver(variant: str, addr: str, epoch: str, config_json: str, dtype_name: str) -> dict:
    """In THIS (fresh) process: join `epoch`, receive one update the `variant` way, report the memory it added."""
    import torch
    from transformers import Qwen2Config

    from rlkube.bench import peak_memory
    from rlkube.core.hf import state as hf_state
    from rlkube.core.weights.group import WeightReceiver
    from rlkube.core.weights.wire import DTYPES, weights_checksum

    torch.set_num_threads(1)
    model = _served_model(Qwen2Config.from_dict(json.loads(config_json)), DTYPES[dtype_name])
    targets = hf_state.named_weights(model)
    rx = WeightReceiver(addr, rank=1, world_size=2, timeout_s=300, local_host="127.0.0.1")
    rx.join(epoch)
    before = peak_memory.reset_peak()
    t0 = time.monotonic()
    if variant == "today":
        _, state = rx.receive()
        hf_state.load_weights(model, state)
        del state
    else:
        rx.receive_streamed(lambda stream: hf_state.copy_into(targets, stream), reuse=True)
    seconds = time.monotonic() - t0
    peak = peak_memory.peak()
    served = weights_checksum(targets.items())
    rx.close()
    return {"variant": variant, "rss_before": before, "rss_peak": peak, "extra_peak": peak - before,
            "seconds": seconds, "received_checksum": rx.last_checksum, "served_checksum": served}


def _weights(config, dtype, seed: int):
    """Random weights of the model's shapes (HF names, the tied head once), without building the model's init."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    # On the meta device every tensor looks shared: drop the tied head by name (named_weights sends it once).
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()
              if not (config.tie_word_embeddings and n == "lm_head.weight")}
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for n, shape in shapes.items()}


def measure(config, dtype_name: str = "bfloat16", bucket_bytes: int | None = None, seed: int = 0,
            variants=VARIANTS) -> dict:
    """Run one update per variant into a fresh receiver process; -> {"model_bytes", "bucket_bytes",
    "largest_tensor_bytes", "params", variant: the receiver's report}."""
    from rlkube.core.weights.group import WeightSender
    from rlkube.core.weights.wire import DTYPES, checksums_match
    from rlkube.local.ports import free_port

    dtype = DTYPES[dtype_name]
    weights = _weights(config, dtype, seed)
    largest = max(t.numel() * t.element_size() for t in weights.values())
    if bucket_bytes is None:
        bucket_bytes = math.ceil(largest / (32 * MIB)) * 32 * MIB
    out = {"params": sum(t.numel() for t in weights.values()),
           "model_bytes": sum(t.numel() * t.element_size() for t in weights.values()),
           "largest_tensor_bytes": largest, "bucket_bytes": bucket_bytes, "dtype": dtype_name}
    addr = f"127.0.0.1:{free_port()}"
    sender = WeightSender(addr, 2, timeout_s=300, local_host="127.0.0.1", transfer_dtype=dtype,
                          bucket_bytes=bucket_bytes)
    packed = sender.pack(weights.items())
    del weights
    try:
        for variant in variants:
            epoch = sender.open()
            cmd = [sys.executable, "-m", "rlkube.bench.weight_receive", "--receiver", variant, "--addr", addr,
                   "--epoch", epoch, "--config-json", config.to_json_string(), "--dtype", dtype_name]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
            errors: list[BaseException] = []
            sending = threading.Thread(target=lambda: _send(sender, packed, errors), daemon=True)
            sending.start()
            stdout, stderr = proc.communicate(timeout=1800)
            sending.join(timeout=60)
            if proc.returncode or errors:
                raise RuntimeError(f"{variant} receiver failed (exit {proc.returncode}, {errors}):\n{stderr[-3000:]}")
            report = json.loads(stdout.strip().splitlines()[-1])
            report["checksum_ok"] = (checksums_match(report["received_checksum"], packed.meta["checksum"])
                                     and checksums_match(report["served_checksum"], packed.meta["checksum"]))
            out[variant] = report
    finally:
        sender.close()
        del packed
    return out


def _send(sender, packed, errors: list) -> None:
    try:
        sender.send(packed, 1)
    except BaseException as exc:  # noqa: BLE001 - reported by measure()
        errors.append(exc)


def cli(args: argparse.Namespace) -> int:
    if args.receiver:  # child: one receiver, JSON on stdout
        print(json.dumps(run_receiver(args.receiver, args.addr, args.epoch, args.config_json, args.dtype)))
        return 0
    config = qwen2_config(args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads)
    bucket = args.bucket_megabytes * MIB if args.bucket_megabytes else None
    r = measure(config, args.dtype, bucket)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"one weight update of a random Qwen2-shaped model: {r['params'] / 1e9:.3f}B parameters, {args.dtype}, "
          f"{r['model_bytes'] / MIB:.0f} MiB; bucket {r['bucket_bytes'] / MIB:.0f} MiB (largest tensor "
          f"{r['largest_tensor_bytes'] / MIB:.0f} MiB); gloo on loopback, CPU")
    for variant in VARIANTS:
        v = r[variant]
        print(f"  {variant:9s} receiver's extra peak RSS {v['extra_peak'] / MIB:8.1f} MiB = "
              f"{v['extra_peak'] / r['bucket_bytes']:5.2f} x bucket = {v['extra_peak'] / r['model_bytes']:4.2f} x "
              f"model; {v['seconds']:.1f}s; checksum {'ok' if v['checksum_ok'] else 'MISMATCH'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Qwen2-0.5B's shape by default."""
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--intermediate", type=int, default=4864)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="transfer and served dtype")
    p.add_argument("--bucket-megabytes", type=int, default=None,
                   help="default: the smallest multiple of 32 MiB that holds the largest tensor")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m rlkube.bench.weight_receive")
    add_arguments(p)
    p.add_argument("--receiver", choices=VARIANTS)
    p.add_argument("--addr")
    p.add_argument("--epoch")
    p.add_argument("--config-json")
    return cli(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
