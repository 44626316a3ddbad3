"""Streamed receive (rlkube.core.weights.group.WeightReceiver.receive_streamed) costs an inference server one bucket
of memory in an update, not a copy of the model: the extra peak RSS of a receiver process during one update of a
random Qwen2-shaped model (rlkube.bench.weight_receive.measure, what `rlkube bench weight-receive` prints at
Qwen2-0.5B's size), streamed beside today's all-buckets-first receive, both verified by checksum."""

from __future__ import annotations

import pytest
from rlkube.bench.weight_receive import measure, qwen2_config

MIB = 2**20


@pytest.mark.timeout(600)
def test_a_streamed_update_needs_one_bucket_where_the_whole_update_needed_the_model():
    # 0.13B parameters, 248 MiB in bfloat16, in 48 MiB buckets (the largest tensor, the embedding, is 16 MiB).
    config = qwen2_config(vocab=8192, hidden=1024, intermediate=4096, layers=8, heads=8, kv_heads=2)
    r = measure(config, "bfloat16", bucket_bytes=48 * MIB)
    assert r["largest_tensor_bytes"] <= r["bucket_bytes"] < r["model_bytes"] / 4
    today, streamed = r["today"], r["streamed"]
    assert today["checksum_ok"] and streamed["checksum_ok"], r
    assert today["extra_peak"] >= r["model_bytes"], r
    assert streamed["extra_peak"] <= 1.2 * r["bucket_bytes"], r
