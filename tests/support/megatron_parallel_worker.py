"""One trainer rank of the megatron parallelism tests (test_megatron_parallel.py), run as a script per rank with
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; none for a single process).

It builds the Trainer as the trainer role does (rlkube.core.backends.torch_distributed.DataParallel, then the
megatron backend with `spec.trainer.megatron.tensorParallel`), exports the weights after loading, trains two steps
on its data-parallel share of a fixed set of documents (data rank r takes documents r, r+DP, ...; tensor-parallel
peers take the same), exports again after each, and rank 0 saves everything (metrics, weights, Adam state) to
`out` for the test to compare with tensor parallel 1 on one process. With CHECKPOINT_DIR every rank takes part in
writing a checkpoint after step 1 (rank 0 writes it); with `resume` as well, rank 0 resumes from the checkpoint
there instead and hands it to the other ranks (as the trainer role does), and the worker trains step 2 only.

    python megatron_parallel_worker.py MODEL_DIR TENSOR_PARALLEL OUT [--checkpoints DIR [--resume]] [--dtype D]
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

STEPS = 2


def documents(n: int = 8, seed: int = 0):
    """GRPO documents: a 4-token prompt, completions of 3-20 tokens with sampling log-probs (varied lengths pad)."""
    from rlkube.contract import protocol

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = 4 + int(rng.integers(3, 21))
        tokens = rng.integers(3, 40, size=length).astype(np.int64)
        old = np.zeros(length, dtype=np.float32)
        old[4:] = -rng.uniform(3.0, 4.5, size=length - 4)
        out.append(protocol.Document(tokens, [(0, 4)], advantage=float(rng.normal()), reward=0.5,
                                     old_log_probabilities=old, model_version=np.zeros(length, dtype=np.int64)))
    return out


def spec_of(model_dir: str, tensor_parallel: int, world: int, dtype: str = "float32"):
    from rlkube.lifecycle.validation import parse_spec

    return parse_spec({
        "model": {"path": model_dir, "dtype": dtype, "maxSequenceLength": 64},
        "algorithm": {"maxSteps": 10, "samplesPerStep": 8, "learningRate": 0.003},
        "inference": {"engine": "native"},
        "trainer": {"backend": "megatron", "processesPerNode": world,
                    "megatron": {"tensorParallel": tensor_parallel}},
    })


def main(model_dir: str, tensor_parallel: int, out: str, checkpoint_dir: str | None = None,
         resume: bool = False, dtype: str = "float32") -> None:
    from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
    from rlkube.core.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = DataParallel(DistConfig.from_env()) if world > 1 else None
    t0 = time.monotonic()
    trainer = Trainer(spec_of(model_dir, tensor_parallel, world, dtype), dp=dp, model_dir=model_dir)
    load_s = time.monotonic() - t0
    leader = dp is None or dp.is_leader
    if checkpoint_dir is not None and leader:
        trainer.checkpoint_dir = Path(checkpoint_dir)
    if resume:
        if leader:
            trainer.resume()
        trainer.sync_from_leader()
    data_rank, data_size = (dp.data_rank, dp.data_size) if dp else (0, 1)
    docs = documents()[data_rank::data_size]
    def export():  # a collective with tensor parallelism; copies (some tensors are the masters' own storage)
        return {name: tensor.clone() for name, tensor in trainer.backend.weights()}

    weights = [export()]
    metrics, step_s = [], []
    while trainer.step < STEPS:
        t0 = time.monotonic()
        metrics.append(trainer.train_step(docs))
        step_s.append(time.monotonic() - t0)
        weights.append(export())
        if checkpoint_dir is not None and not resume and trainer.step == 1 and (leader or trainer.collective):
            trainer.save_checkpoint()  # as the trainer role: rank 0, or every rank with tensor parallelism
    backend = trainer.backend
    # this rank's float32 masters and Adam moments (its shards with tensor parallelism)
    local_bytes = (sum(m.numel() * m.element_size() for m in backend.masters.values())
                   + sum(v.numel() * v.element_size() for s in backend.optimizer.state.values()
                         for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0))
    _, optimizer = backend.state()
    if leader:
        torch.save({"metrics": metrics, "weights": weights, "optimizer": optimizer["optimizer"],
                    "layout": [data_size, tensor_parallel], "load_s": load_s, "step_s": step_s,
                    "local_bytes": local_bytes}, out)
    if dp is not None:
        dp.finish()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("tensor_parallel", type=int)
    parser.add_argument("out")
    parser.add_argument("--checkpoints")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dtype", default="float32")
    a = parser.parse_args()
    main(a.model_dir, a.tensor_parallel, a.out, a.checkpoints, a.resume, a.dtype)
