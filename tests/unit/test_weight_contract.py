"""The weight contract's pure parts: tensors packed into buckets in the transfer dtype and unpacked by name, the
checksum that trainer and engine compare."""

from __future__ import annotations

import pytest
import torch
from rlkube.core.weights.wire import checksums_match, pack_weights, transfer_dtype, unpack_weights, weights_checksum


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(10, 4, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
        "model.norm.weight": torch.ones(4),
        "steps": torch.arange(3),
        "lm_head.weight": torch.randn(10, 4, generator=g),
    }


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16])
def test_pack_then_unpack_gives_every_tensor_by_name_in_the_transfer_dtype(dtype):
    w = weights()
    packed = pack_weights(w.items(), dtype, bucket_bytes=100)
    got = unpack_weights(packed.meta, packed.buffers)
    assert list(got) == list(w)
    for name, t in w.items():
        want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert checksums_match(packed.meta["checksum"], weights_checksum(got.items()))


def test_buckets_hold_consecutive_tensors_of_one_dtype_within_the_size():
    w = weights()
    packed = pack_weights(w.items(), torch.float32, bucket_bytes=100)
    # embed 160 B alone (over the size), q 64 B + norm 16 B together, the int64 counter alone, lm_head alone
    assert [(first, end, dtype) for first, end, dtype, _ in packed.meta["buckets"]] == [
        (0, 1, "float32"), (1, 3, "float32"), (3, 4, "int64"), (4, 5, "float32")]
    assert len(packed.buffers) == 4
    one = pack_weights(w.items(), torch.float32, bucket_bytes=2**20)
    assert len(one.buffers) == 3  # floats, the int counter, floats again: dtype changes split buckets


def test_packing_is_a_snapshot():
    w = weights()
    packed = pack_weights(w.items(), None)
    w["model.norm.weight"].add_(1.0)  # the trainer steps on while the transfer runs
    assert torch.equal(unpack_weights(packed.meta, packed.buffers)["model.norm.weight"], torch.ones(4))


def test_checksum_sees_values_and_names_not_order():
    w = weights()
    base = weights_checksum(w.items())
    assert checksums_match(weights_checksum(reversed(list(w.items()))), base)
    changed = dict(w)
    changed["model.norm.weight"] = w["model.norm.weight"] + 1e-3
    assert not checksums_match(weights_checksum(changed.items()), base)
    swapped = dict(w)
    swapped["model.embed_tokens.weight"], swapped["lm_head.weight"] = w["lm_head.weight"], w["model.embed_tokens.weight"]
    assert not checksums_match(weights_checksum(swapped.items()), base)


def test_auto_transfer_dtype_is_the_dtype_the_engine_serves():
    assert transfer_dtype("auto", "float32") == torch.float32
    assert transfer_dtype("auto", "bfloat16") == torch.bfloat16
    assert transfer_dtype("bfloat16", "float32") == torch.bfloat16
