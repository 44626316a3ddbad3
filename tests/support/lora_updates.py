"""What the LoRA weight-update tests share (tests/integration/weights/test_lora_weight_updates.py with the native
engine, tests/integration/inference/test_lora_vllm.py with vLLM): the adapted modules and made-up documents."""

from __future__ import annotations

import numpy as np

from rlkube.contract import protocol

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def documents(n: int, seed: int) -> list[protocol.Document]:
    """Digit strings, the first 4 tokens the prompt, made-up sampling log-probs and advantages."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n):
        ids = rng.integers(3, 40, 12).astype(np.int64)
        old = np.zeros(len(ids), dtype=np.float32)
        old[4:] = -rng.uniform(2.0, 5.0, len(ids) - 4)
        docs.append(protocol.Document(ids, [(0, 4)], advantage=float(rng.normal()), reward=0.5,
                                      old_log_probabilities=old, model_version=np.zeros(len(ids), dtype=np.int64)))
    return docs
