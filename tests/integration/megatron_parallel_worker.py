"""One trainer rank of the megatron parallelism tests (test_megatron_parallel.py), run as a script per rank with
torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; none for a single process).

It builds the Trainer as the trainer role does (rlkube.core.backends.torch_distributed.DataParallel, then the
megatron backend with `spec.trainer.megatron.tensorParallel`), exports the weights after loading, trains two steps
on its data-parallel share of a fixed set of documents (data rank r takes documents r, r+DP, ...; tensor-parallel
peers take the same), exports again after each, and rank 0 saves everything (metrics, weights, Adam state) to
`out` for the test to compare with tensor parallel 1 on one process.

    python megatron_parallel_worker.py MODEL_DIR TENSOR_PARALLEL OUT [DTYPE]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch

STEPS = 2


def documents(n: int = 8, seed: int = 0):
    """GRPO documents: a 4-token prompt, completions of 3-20 tokens with sampling log-probs (varied lengths pad)."""
    from rlkube.core import protocol

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
    from rlkube.api.validation import parse_spec

    return parse_spec({
        "model": {"path": model_dir, "dtype": dtype, "maxSequenceLength": 64},
        "algorithm": {"maxSteps": 10, "samplesPerStep": 8, "learningRate": 0.003},
        "inference": {"engine": "native"},
        "trainer": {"backend": "megatron", "processesPerNode": world,
                    "megatron": {"tensorParallel": tensor_parallel}},
    })


def main(model_dir: str, tensor_parallel: int, out: str, dtype: str = "float32") -> None:
    from rlkube.core.backends.torch_distributed import DataParallel, DistConfig
    from rlkube.core.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = DataParallel(DistConfig.from_env()) if world > 1 else None
    t0 = time.monotonic()
    trainer = Trainer(spec_of(model_dir, tensor_parallel, world, dtype), dp=dp, model_dir=model_dir)
    load_s = time.monotonic() - t0
    data_rank, data_size = (dp.data_rank, dp.data_size) if dp else (0, 1)
    docs = documents()[data_rank::data_size]
    def export():  # a collective with tensor parallelism; copies (some tensors are the masters' own storage)
        return {name: tensor.clone() for name, tensor in trainer.backend.weights()}

    weights = [export()]
    metrics, step_s = [], []
    for _ in range(STEPS):
        t0 = time.monotonic()
        metrics.append(trainer.train_step(docs))
        step_s.append(time.monotonic() - t0)
        weights.append(export())
    _, optimizer = trainer.backend.state()
    if dp is None or dp.is_leader:
        torch.save({"metrics": metrics, "weights": weights, "optimizer": optimizer["optimizer"],
                    "layout": [data_size, tensor_parallel], "load_s": load_s, "step_s": step_s}, out)
    if dp is not None:
        dp.finish()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
