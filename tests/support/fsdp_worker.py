"""One trainer rank with `spec.trainer.sharding: fsdp` for test_trainer_fsdp: joins the gloo group (the trainer's
own DataParallel), optionally resumes from the shared checkpoint directory, trains `--steps` steps on its share of
each step's documents (as the trainer role splits them), saves a checkpoint, and writes its parameter and Adam
bytes to `--report`. Documents come from core_roles.make_documents (the same on every rank and in the test).

With spec.trainer.lora (test_lora_fsdp) rank 0 also writes, next to the report, the adapter it started from
(`-initial.safetensors`, before training on a fresh start), the frozen base after training (`-base.safetensors`,
gathered under PEFT's module names), and both weight streams (merged weights and adapter alone) as a receiver
would unpack them (`-stream-full.safetensors`, `-stream-adapter.safetensors`) with their metadata."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from support.core_roles import make_documents
from rlkube.core.backends.fsdp_lora import full
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
from rlkube.core.trainer import Trainer
from rlkube.core.weights.wire import unpack_weights, weights_checksum
from safetensors.torch import save_file


def share(docs: list, rank: int, world: int) -> list:
    """Rank `rank`'s contiguous share: sizes differ by at most one (lower ranks take the extra ones)."""
    base, extra = divmod(len(docs), world)
    start = rank * base + min(rank, extra)
    return docs[start:start + base + (1 if rank < extra else 0)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--checkpoints", required=True)
    ap.add_argument("--first-step", type=int, default=0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--per-step", type=int, required=True)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--report", required=True)
    args = ap.parse_args()
    spec = parse_spec(json.loads(Path(args.spec).read_text()))
    dp = DataParallel(DistConfig.from_env())
    trainer = Trainer(spec, checkpoint_dir=Path(args.checkpoints), dp=dp)
    if args.first_step:
        trainer.resume()
        assert trainer.step == args.first_step, trainer.step
    lora = spec.trainer.lora is not None
    if lora and not args.first_step:
        initial, _ = trainer.backend.full_state()  # collective: the adapter, gathered on rank 0
        if dp.is_leader:
            save_file(initial, str(Path(args.report).with_suffix(".initial.safetensors")))
    docs = make_documents((args.first_step + args.steps) * args.per_step, seed=args.seed)
    metrics = []
    for k in range(args.first_step, args.first_step + args.steps):
        step_docs = docs[k * args.per_step:(k + 1) * args.per_step]
        metrics.append(trainer.train_step(share(step_docs, dp.rank, dp.world_size)))
    path = trainer.save_checkpoint()
    # Weight publishing's source: every rank iterates (one parameter gathered at a time), rank 0 keeps them.
    published, largest = {}, 0
    for name, tensor in trainer.backend.weights():
        largest = max(largest, tensor.numel())
        if dp.is_leader:
            published[name] = tensor.clone()
    if dp.is_leader:
        save_file(published, str(Path(args.report).with_suffix(".safetensors")))
    streams = {}
    if lora:
        base = {n: full(p.detach()).clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
        if dp.is_leader:
            save_file(base, str(Path(args.report).with_suffix(".base.safetensors")))
        for kind, adapter in (("full", False), ("adapter", True)):
            stream = trainer.backend.weight_stream(None, 1 << 13, adapter=adapter)  # 8 KiB buckets: several
            if dp.is_leader:  # what WeightSender does with it (one pass), then what a receiver unpacks
                stream.more(True)
                buffers = [b.clone() for b in stream.buckets()]
                stream.more(False)
                got = unpack_weights(stream.meta, buffers)
                save_file({k: v.contiguous() for k, v in got.items()},
                          str(Path(args.report).with_suffix(f".stream-{kind}.safetensors")))
                streams[kind] = {"meta": stream.meta, "received_checksum": weights_checksum(got.items())}
            else:
                stream.drain()
    Path(args.report).write_text(json.dumps({"bytes": trainer.backend.local_bytes(), "metrics": metrics,
                                             "checkpoint": str(path), "rank": dp.rank,
                                             "largest_gathered": largest, "streams": streams}))
    dp.finish()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
