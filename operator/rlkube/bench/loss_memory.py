"""`rlkube bench loss-memory`: peak host memory of ONE loss + backward at a real vocabulary, the full-logits loss
(`backends.base.batch_loss` on [B, T, V] float32 logits, what the backends did before) against the chunked one
(`losses.chunked_token_logprobs` from the final hidden states, what `TorchBackend.forward_backward` does now).

Why a benchmark and not a test: memory numbers depend on the machine's allocator; the equality of the two paths is
asserted in tests/unit/test_chunked_loss.py, and this prints it again at the full size (max differences).

How: each variant runs in a FRESH subprocess (the peak RSS of a process only grows) on a random Qwen2 model of the
given vocabulary with a tiny hidden size on CPU; after building the model and batch (and one small warm-up pass) the
process resets its peak RSS, runs the loss + backward and reports the peak minus the RSS it started from
(bench/peak_memory.py): what the loss step added at its peak. tracemalloc does not see torch's allocations, RSS
does. Each variant saves its loss and the gradients of the (tied) embedding and the final norm, which the parent
compares.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

VARIANTS = ("full", "chunked")


def _model_and_batch(vocab: int, tokens: int, hidden: int, sequences: int, seed: int):
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlkube.contract import protocol
    from rlkube.core.training.batch import collate

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=tokens + 8,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).float().train()
    rng = np.random.default_rng(seed)
    length = tokens // sequences + 1  # tokens predicted per sequence: length - 1
    docs = []
    for _ in range(sequences):
        ids = rng.integers(0, vocab, size=length).astype(np.int64)
        old = rng.normal(-12.0, 0.5, size=length).astype(np.float32)
        docs.append(protocol.Document(ids, [(0, 1)], advantage=float(rng.normal()), reward=0.0,
                                      old_log_probabilities=old, model_version=np.zeros(length, dtype=np.int64)))
    return model, collate(docs, 0)


def run_variant(variant: str, vocab: int, tokens: int, hidden: int, sequences: int, chunk: int, temperature: float,
                out: Path, seed: int = 0) -> dict:
    """In THIS process (meant to be fresh): one loss + backward; returns the RSS numbers, saves loss and gradients."""
    import torch

    from rlkube.bench import peak_memory
    from rlkube.core.backends.base import batch_loss, logprob_loss
    from rlkube.core.backends.torch_backend import model_logits, model_logprobs
    from rlkube.core.training.losses import LossConfig

    torch.set_num_threads(1)
    model, batch = _model_and_batch(vocab, tokens, hidden, sequences, seed)
    config = LossConfig("grpo")
    normalizer = float(batch.num_loss_tokens)

    def step(b):
        if variant == "full":
            return batch_loss(model_logits(model, b.tokens, nullcontext), b, config, temperature, normalizer)
        logp, entropy = model_logprobs(model, b.tokens, nullcontext, temperature, chunk)
        return logprob_loss(logp, entropy, b, config, normalizer)

    step(_head(batch, 2)).loss.backward()  # warm-up: small, then zero
    model.zero_grad(set_to_none=True)
    before = peak_memory.reset_peak()
    result = step(batch)
    result.loss.backward()
    after = peak_memory.peak()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if n in ("model.embed_tokens.weight", "model.norm.weight")}
    torch.save({"loss": result.loss.detach(), "grads": grads, "stats": vars(result.stats)}, out)
    return {"variant": variant, "rss_before": before, "rss_peak": after, "loss_step_peak": after - before,
            "loss": float(result.loss)}


def _head(batch, n: int):
    """The first `n` positions of every sequence (a small warm-up batch)."""
    from dataclasses import replace

    return replace(batch, tokens=batch.tokens[:, :n + 1], loss_mask=batch.loss_mask[:, :n],
                   old_logprobs=batch.old_logprobs[:, :n])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlkube bench loss-memory", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return cli(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen2/3's by default)")
    parser.add_argument("--tokens", type=int, default=4096, help="predicted tokens in the micro-batch")
    parser.add_argument("--sequences", type=int, default=4, help="sequences the tokens are split into")
    parser.add_argument("--hidden", type=int, default=16, help="hidden size of the random model")
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked loss")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", help=argparse.SUPPRESS)


def cli(args: argparse.Namespace) -> int:
    """`rlkube bench loss-memory` (the parent: runs each variant in a fresh subprocess and compares)."""
    common = (args.vocab, args.tokens, args.hidden, args.sequences, args.chunk, args.temperature)
    if args.variant:  # child: one variant, JSON on stdout
        print(json.dumps(run_variant(args.variant, *common, Path(args.out))))
        return 0
    import torch

    results, saved = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            out = Path(tmp) / f"{variant}.pt"
            cmd = [sys.executable, "-m", "rlkube.bench.loss_memory", "--variant", variant, "--out", str(out),
                   "--vocab", str(args.vocab), "--tokens", str(args.tokens), "--sequences", str(args.sequences),
                   "--hidden", str(args.hidden), "--chunk", str(args.chunk), "--temperature", str(args.temperature)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(f"{variant}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            saved[variant] = torch.load(out, weights_only=True)
    gib = 1024 ** 3
    one_copy = args.tokens * args.vocab * 4
    print(f"one loss + backward, vocabulary {args.vocab:,}, {args.tokens:,} tokens ({args.sequences} sequences), "
          f"hidden {args.hidden}, temperature {args.temperature}, chunk {args.chunk} tokens; CPU, float32; "
          f"one [tokens, vocabulary] float32 tensor = {one_copy / gib:.2f} GiB")
    for variant in VARIANTS:
        r = results[variant]
        print(f"  {variant:8s} peak RSS {r['rss_peak'] / gib:6.2f} GiB (before the step {r['rss_before'] / gib:.2f} "
              f"GiB): the loss step added {r['loss_step_peak'] / gib:6.2f} GiB; loss {r['loss']:.8f}")
    ratio = results["chunked"]["loss_step_peak"] / max(results["full"]["loss_step_peak"], 1)
    print(f"  the chunked loss step adds {ratio:.3f} of what the full-logits one adds")
    full, chunked = saved["full"], saved["chunked"]
    loss_diff = abs(float(full['loss'] - chunked['loss']))
    print(f"  |loss difference| {loss_diff:.2e}")
    grad_diffs = {}
    for name, grad in full["grads"].items():
        grad_diffs[name] = diff = float((grad - chunked["grads"][name]).abs().max())
        scale = float(grad.abs().max())
        print(f"  max |gradient difference| {name}: {diff:.2e} (max |gradient| {scale:.2e})")
    for key in ("loss_sum", "ratio_sum", "kl_sum", "entropy_sum"):
        print(f"  {key}: full {full['stats'][key]:.6f} chunked {chunked['stats'][key]:.6f}")
    print(json.dumps({"vocab": args.vocab, "tokens": args.tokens, "chunk": args.chunk,
                      "full_added_bytes": results["full"]["loss_step_peak"],
                      "chunked_added_bytes": results["chunked"]["loss_step_peak"], "ratio": round(ratio, 4),
                      "loss_difference": loss_diff, "max_gradient_difference": grad_diffs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
