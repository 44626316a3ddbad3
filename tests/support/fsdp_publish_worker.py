"""One trainer rank of test_fsdp_weight_stream (not a test): FSDP over the gloo group of `WORLD_SIZE` ranks, the
sharded trainer publishing its weights through rank 0's WeightPublisher to a WeightReceiver in the test process.

Every rank: start_weights() (version 0, streamed bucket by bucket), one training step, publish_weights() (version 1,
streamed); then the same weights once more through the UNSHARDED path (rank 0 packs the gathered full state as a
replicated trainer would; with LoRA and the native engine, the gathered adapter as an AdapterUpdate) as version
101, for the receiver to compare. Rank 0 writes to `--report` what it sent:
the streamed and the packed metadata, the stream's peak of gathered bytes, the model's bytes."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import redis
import torch
from support.core_roles import make_documents
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
from rlkube.contract.protocol import StreamKeys
from rlkube.core.trainer import Trainer
from rlkube.core.training.lora import wire_config
from rlkube.core.weights.publication import WeightPublisher
from rlkube.core.weights.wire import AdapterUpdate, pack_weights, transfer_dtype


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--redis", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--report", required=True)
    args = ap.parse_args()
    spec = parse_spec(json.loads(Path(args.spec).read_text()))
    dp = DataParallel(DistConfig.from_env())
    transfer = spec.trainer.weight_transfer
    dtype, bucket_bytes = transfer_dtype(transfer.dtype), transfer.bucket_megabytes * 2**20
    publisher = None
    if dp.is_leader:
        publisher = WeightPublisher(redis.Redis.from_url(args.redis), StreamKeys(args.prefix), args.addr, 2,
                                    timeout_s=60, transfer_dtype=dtype, bucket_bytes=bucket_bytes)
    trainer = Trainer(spec, dp=dp, publisher=publisher, model_dir=Path(args.model))
    trainer.start_weights()
    docs = make_documents(4, seed=3)
    trainer.train_step(docs[dp.rank::dp.world_size])
    trainer.publish_weights()
    stream = trainer.last_stream
    full, _ = trainer.backend.full_state()  # collective; rank 0 gets the whole model (the unsharded path)
    if dp.is_leader:
        update = AdapterUpdate(list(full.items()), wire_config(spec.trainer.lora)) if trainer.sends_adapter \
            else full.items()
        packed = pack_weights(update, dtype, bucket_bytes)
        publisher.publish(update, version=101, step=trainer.step)
        publisher.close()
        Path(args.report).write_text(json.dumps({
            "streamed": stream.meta, "packed": packed.meta, "peak_bytes": stream.peak_bytes,
            "passes": stream.passes, "bucket_bytes": bucket_bytes,
            "model_bytes": sum(t.numel() * t.element_size() for t in full.values()),
            "largest_tensor_bytes": max(t.numel() * t.element_size() for t in full.values()),
        }))
    else:
        Path(args.report).write_text(json.dumps({"peak_bytes": stream.peak_bytes, "passes": stream.passes}))
    dp.finish()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.manual_seed(0)
    raise SystemExit(main())
