"""Fast-LLM's weight broadcast, received as both engines receive it (rlkube.core.weights.fast_llm), from a sender
that frames it as Fast-LLM's own broadcast code does (fast_llm_stand_in.py, after fast_llm/core/distributed.py
and the streaming callback at the recorded commit), over gloo on loopback. One test per rendezvous fact: the world size
of replicas x tensorParallel, the rank order, the store prefix, the end marker; and the metadata (pickled shape and
dtype, non-weight shards dropped)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist
from support.fast_llm_stand_in import broadcast_group, send, send_pickled
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import fastllm
from rlkube.contract import fast_llm_rendezvous, runtime
from rlkube.core.weights.fast_llm import FastLlmReceiver, unpickle_metadata
from rlkube.core.weights.group import WeightSyncError
from rlkube.local.ports import free_port

TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(autouse=True)
def under_torchrun(monkeypatch):
    # Fast-LLM's ranks run under torchrun, whose agent store makes rank 0's rendezvous a client of the store the
    # launcher hosts (rlkube.core.launch.fast_llm); the receivers are clients either way.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")


def spec(replicas: int, tp: int):
    from support import ROOT
    import yaml

    raw = yaml.safe_load((ROOT / "examples" / "fast-llm.yaml").read_text())["spec"]
    raw["inference"] = {**raw["inference"], "replicas": replicas, "tensorParallel": tp}
    return parse_spec(raw)


class Group:
    """Fast-LLM's rank 0 (a thread running the stand-in's Fast-LLM code, the store hosted as the trainer pod's
    launcher hosts it) and `receivers` FastLlmReceivers joining in threads."""

    def __init__(self, world: int, ranks: list[int]):
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, None, True, TIMEOUT, wait_for_workers=False)
        self.receivers = [FastLlmReceiver(f"127.0.0.1:{self.port}", r, world, timeout_s=30) for r in ranks]
        joins = [threading.Thread(target=r.join) for r in self.receivers]
        for t in joins:
            t.start()
        self.sender = broadcast_group("127.0.0.1", self.port, world - 1, "gloo", TIMEOUT)
        for t in joins:
            t.join(30)
        assert all(r.joined for r in self.receivers)

    def send(self, *updates) -> list[list]:
        """Each update a list of (shard, name, tensor); returns what every receiver got, per update."""
        got = [[] for _ in self.receivers]

        def recv(i):
            for _ in updates:
                got[i].append(self.receivers[i].receive())

        threads = [threading.Thread(target=recv, args=(i,)) for i in range(len(self.receivers))]
        for t in threads:
            t.start()
        for update in updates:
            for shard, name, tensor in update:  # fast_llm/engine/training/streaming.py:112-116
                send_pickled(self.sender, (shard, name, tensor.shape, tensor.dtype))
                send(self.sender, tensor)
            send_pickled(self.sender, None)  # streaming.py:118-119
        for t in threads:
            t.join(30)
        return got

    def close(self):
        for r in self.receivers:
            r.close()


@pytest.mark.parametrize(("replicas", "tp"), [(1, 1), (1, 2), (3, 2), (2, 4)])
def test_world_size_is_every_tensor_parallel_worker_of_every_server_plus_fast_llms_rank_0(replicas, tp):
    s = spec(replicas, tp)
    broadcast = fastllm.training_config(s, "ns", "j")["callbacks"]["streaming"]["broadcast"]
    assert broadcast["external_world_size"] == replicas * tp
    assert fast_llm_rendezvous.world_size(s) == replicas * tp + 1 == runtime.weight_sync_world_size(s)


@pytest.mark.parametrize(("replicas", "tp"), [(1, 2), (3, 2), (2, 4)])
def test_rank_order_is_server_major_then_tensor_parallel_rank(replicas, tp):
    # PipelineRL's receiver (pipelinerl/vllm1.py on its fast-llm branch): pg_rank = 1 + actor_idx * ngpus + rank.
    s = spec(replicas, tp)
    ranks = [runtime.weight_sync_rank(s, i, t) for i in range(replicas) for t in range(tp)]
    assert ranks == [1 + i * tp + t for i in range(replicas) for t in range(tp)]
    assert sorted(ranks) == list(range(1, fast_llm_rendezvous.world_size(s)))


def test_ranks_out_of_the_group_are_refused():
    with pytest.raises(ValueError):
        FastLlmReceiver("127.0.0.1:1", 0, 3)  # rank 0 is Fast-LLM's
    with pytest.raises(ValueError):
        FastLlmReceiver("127.0.0.1:1", 3, 3)


def test_store_prefix_is_fast_llms_range_prefix():
    assert fast_llm_rendezvous.store_prefix(5) == "range_0_5_1/"
    # Live: four ranks (rank 0 Fast-LLM's code, three receivers) form the group under that prefix: the keys gloo
    # wrote are there, and one broadcast reaches every receiver.
    g = Group(4, [1, 2, 3])
    try:
        assert any(k.startswith("range_0_4_1/") for k in g.store.list_keys())
        got = g.send([("weights", "w", torch.arange(4.0))])
        assert [[{k: v.tolist() for k, v in u.items()} for u in r] for r in got] == [[{"w": [0, 1, 2, 3]}]] * 3
    finally:
        g.close()


def test_end_marker_ends_each_update_and_metadata_order_dtype_and_shards_follow_fast_llm():
    g = Group(2, [1])
    try:
        first = [("weights", "model.embed_tokens.weight", torch.ones(3, 2, dtype=torch.bfloat16)),
                 ("grads", "model.embed_tokens.weight", torch.full((3, 2), 7.0)),  # not a weight: dropped
                 ("weights", "model.norm.weight", torch.arange(2, dtype=torch.float32))]
        second = [("weights", "model.norm.weight", torch.tensor([5.0, 6.0]))]
        ((a, b),) = g.send(first, second)
        # The first update ends at its end marker (the second is not mixed into it), in Fast-LLM's order and dtypes.
        assert list(a) == ["model.embed_tokens.weight", "model.norm.weight"]
        assert (a["model.embed_tokens.weight"].dtype, a["model.norm.weight"].dtype) == (torch.bfloat16, torch.float32)
        assert a["model.embed_tokens.weight"].tolist() == [[1.0, 1.0]] * 3
        assert {k: v.tolist() for k, v in b.items()} == {"model.norm.weight": [5.0, 6.0]}
    finally:
        g.close()


def test_metadata_is_unpickled_to_shapes_and_dtypes_only():
    import pickle

    meta = ("weights", "x", torch.Size([2, 3]), torch.bfloat16)
    assert unpickle_metadata(pickle.dumps(meta)) == meta
    with pytest.raises(WeightSyncError):
        unpickle_metadata(pickle.dumps(("weights", "x", torch.Size([1]), torch.zeros(1))))  # a tensor: refused


def test_a_streamed_receive_hands_each_weight_on_as_it_arrives_and_drops_what_the_engine_leaves():
    # As the native engine receives (FastLlmReceiver.receive_streamed): tensor by tensor, the non-weight shard
    # dropped, the checksum summed as they go by; a load that stops early (a weight that does not fit) leaves the
    # rest to be received and dropped, so the next update arrives whole.
    from rlkube.core.weights.wire import weights_checksum

    g = Group(2, [1])
    rx = g.receivers[0]
    first = [("weights", "a", torch.arange(3.0)), ("grads", "a", torch.full((3,), 7.0)),
             ("weights", "b", torch.ones(2, 2, dtype=torch.bfloat16)), ("weights", "c", torch.tensor([4.0]))]
    second = [("weights", "c", torch.tensor([9.0]))]
    seen: list[list] = []

    def stop_after_one(stream):
        name, tensor = next(stream)
        seen.append([name, tensor.tolist()])

    def take_all(stream):
        seen.append([(name, tensor.tolist()) for name, tensor in stream])

    results: list = []

    def recv():
        try:
            results.append(rx.receive_streamed(stop_after_one))
            results.append(rx.last_checksum)
            results.append(rx.receive_streamed(take_all))
        except Exception as exc:  # noqa: BLE001 - asserted below
            results.append(exc)

    t = threading.Thread(target=recv)
    t.start()
    try:
        for update in (first, second):
            for shard, name, tensor in update:
                send_pickled(g.sender, (shard, name, tensor.shape, tensor.dtype))
                send(g.sender, tensor)
            send_pickled(g.sender, None)
        t.join(30)
        assert results[0] is None and results[2] is None  # the wire carries no version: the step is it
        assert seen == [["a", [0.0, 1.0, 2.0]], [("c", [9.0])]]
        assert results[1] == weights_checksum([(n, t) for s, n, t in first if s == "weights"])
        assert rx.last_checksum == weights_checksum([("c", torch.tensor([9.0]))]) and rx.joined
    finally:
        g.close()
