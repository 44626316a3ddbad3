"""The weight-update group's layout with tensor-parallel inference: one formula for its size and every rank
(rlkube.contract.runtime), what each launcher and role derives from it, and how a vLLM server folds its workers'
answers into one (rlkube.core.inference.vllm_engine.combine_joins / combine_receipts)."""

from __future__ import annotations

import itertools

import pytest
from rlkube.contract.parallel import tensor_parallel_heads_error
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.contract import runtime
from rlkube.contract.context import RoleContext
from rlkube.core.inference.vllm_engine import combine_joins, combine_receipts

pytestmark = pytest.mark.unit


def spec(replicas: int = 1, tp: int = 1, engine: str = "vllm", model: str = "hf://org/m", **trainer):
    return parse_spec({
        "model": {"path": model, "seed": 2},
        "task": {"name": "reverse-digits"},
        "algorithm": {"maxSteps": 2},
        "inference": {"engine": engine, "replicas": replicas, "tensorParallel": tp},
        **({"trainer": trainer} if trainer else {}),
    })


@pytest.mark.parametrize(("replicas", "tp"), [(1, 1), (3, 1), (1, 2), (2, 2), (3, 4)])
def test_every_worker_of_every_server_has_its_own_rank_after_the_trainers(replicas, tp):
    s = spec(replicas, tp)
    world = runtime.weight_sync_world_size(s)
    assert world == 1 + replicas * tp
    ranks = [runtime.weight_sync_rank(s, i, t) for i, t in itertools.product(range(replicas), range(tp))]
    assert sorted(ranks) == list(range(1, world)), "the inference ranks are exactly 1..world-1, each once"
    # a server's workers are consecutive, starting at the rank the server passes them (its worker 0's)
    for i in range(replicas):
        base = runtime.weight_sync_rank(s, i)
        assert [runtime.weight_sync_rank(s, i, t) for t in range(tp)] == list(range(base, base + tp))


def test_ranks_outside_the_job_are_refused():
    s = spec(2, 2)
    with pytest.raises(ValueError, match="inference index 2"):
        runtime.weight_sync_rank(s, 2)
    with pytest.raises(ValueError, match="tensor-parallel rank 2"):
        runtime.weight_sync_rank(s, 0, 2)


def test_the_role_context_uses_the_same_formula():
    s = spec(2, 4)
    ctx = RoleContext(namespace="ns", job="j", spec=s, redis_url="redis://r", index=1)
    assert ctx.weight_sync_world_size == 9
    assert (ctx.weight_sync_rank(), ctx.weight_sync_rank(3)) == (5, 8)


def test_the_native_engine_still_refuses_tensor_parallelism():
    with pytest.raises(SpecError, match=r"spec\.inference\.tensorParallel"):
        spec(1, 2, engine="native")


def test_a_server_joined_only_when_every_worker_did():
    ok = [{"ok": True, "epoch": "e1", "rank": 3}, {"ok": True, "epoch": "e1", "rank": 4}]
    assert combine_joins(ok) == {"ok": True, "epoch": "e1", "ranks": [3, 4]}
    stale = combine_joins([ok[0], {"ok": False, "stale": True, "error": "epoch e1 is stale"}])
    assert stale == {"ok": False, "stale": True, "mismatch": False, "error": "epoch e1 is stale"}
    both = combine_joins([{"ok": False, "stale": False, "error": "timeout"}] * 2)
    assert both == {"ok": False, "stale": False, "mismatch": False, "error": "timeout"}  # the same error said once
    # A worker whose transport disagrees with the trainer's (rlkube.contract.weight_transport) makes it a mismatch.
    mismatch = combine_joins([ok[0], {"ok": False, "stale": False, "mismatch": True, "error": "nccl vs gloo"}])
    assert mismatch == {"ok": False, "stale": False, "mismatch": True, "error": "nccl vs gloo"}


def receipt(**over):
    return {"ok": True, "version": 3, "checksum": 1.5, "served_checksum": 2.0, "transfer_s": 0.1, "load_s": 0.2,
            "progress": {"running": {"a": 2}, "finished": []}, **over}


def test_an_update_is_in_effect_only_when_every_worker_loaded_it():
    one = combine_receipts([receipt()])
    assert one["ok"] and one["served_checksum"] == 2.0 and one["version"] == 3
    two = combine_receipts([receipt(), receipt(transfer_s=0.4, load_s=0.1, progress={"running": {}, "finished": []})])
    assert two["ok"] and two["version"] == 3 and two["checksum"] == 1.5
    assert (two["transfer_s"], two["load_s"]) == (0.4, 0.2)  # the slowest worker's
    assert two["progress"] == {"running": {"a": 2}, "finished": []}  # worker 0's
    assert two["served_checksum"] is None  # a shard's parameters are not the whole tensor
    refused = combine_receipts([receipt(), {"ok": False, "error": "checksum mismatch"}])
    assert refused == {"ok": False, "fatal": False, "error": "checksum mismatch"}
    half = combine_receipts([{"ok": False, "error": "load failed", "fatal": True}, receipt()])
    assert half["fatal"] and not half["ok"]
    apart = combine_receipts([receipt(), receipt(version=4)])
    assert apart["fatal"] and "different versions" in apart["error"]


@pytest.mark.parametrize(("heads", "kv_heads", "tp", "fits"), [
    (2, 2, 2, True), (2, 2, 4, False), (8, 2, 4, True), (8, 2, 3, False), (12, 4, 8, False), (8, 1, 8, True),
    (6, 4, 2, True), (6, 6, 4, False),
])
def test_tensor_parallel_must_split_the_attention_heads_as_vllm_does(heads, kv_heads, tp, fits):
    assert (tensor_parallel_heads_error(heads, kv_heads, tp) is None) == fits


def test_a_built_in_model_that_tensor_parallelism_cannot_split_is_refused_before_any_pod():
    assert runtime.weight_sync_world_size(spec(1, 2, model="builtin://tiny-llama")) == 3  # 2 heads split in 2
    with pytest.raises(SpecError, match=r"spec\.inference\.tensorParallel: builtin://tiny-llama: its 2 attention"):
        spec(1, 4, model="builtin://tiny-llama")
    assert runtime.weight_sync_world_size(spec(1, 4)) == 5  # a Hub model's heads are checked by the server


def test_the_vllm_server_refuses_a_model_it_cannot_split_naming_the_field():
    from types import SimpleNamespace

    from rlkube.core.errors import ConfigError
    from rlkube.core.inference.vllm_engine import tensor_parallel_check

    s = spec(1, 2)
    tensor_parallel_check(s, SimpleNamespace(num_attention_heads=8, num_key_value_heads=2))
    with pytest.raises(ConfigError) as err:
        tensor_parallel_check(s, SimpleNamespace(num_attention_heads=7, num_key_value_heads=7))
    assert err.value.field == "spec.inference.tensorParallel" and "hf://org/m" in str(err.value)
