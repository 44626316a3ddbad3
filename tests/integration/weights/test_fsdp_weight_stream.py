"""Weight publishing of the FSDP-sharded trainer (spec.trainer.sharding: fsdp): two real trainer ranks (gloo) stream
their weights bucket by bucket (every rank gathers one bucket's parameters, rank 0 sends it, frees it, the next)
to a real WeightReceiver in this process, following the weights_ready announcements in real Redis.

Shown: the receiver gets exactly the tensors and checksum it gets from the unsharded publisher (rank 0 packing the
gathered full state), the wire metadata (names, shapes, dtypes, buckets) is identical, and the most bytes rank 0
held at once while streaming is one bucket plus one full tensor, well below the model. With LoRA and the native
engine the stream is the adapter alone (kind lora-adapter), the same as rank 0's packed AdapterUpdate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import pytest
from support.core_roles import (
    add_documents,
    free_port,
    keys_for,
    make_documents,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_trainer,
    tiny_spec,
)
from support.hf_models import builtin_dir
from support.trainer_events import next_weights_ready
from rlkube.contract import protocol, runtime
from rlkube.core.training import lora
from rlkube.core.weights.group import StaleEpoch, WeightReceiver
from rlkube.core.weights.wire import ADAPTER, checksums_match
from rlkube.lifecycle.validation import parse_spec

from support import DIR as SUPPORT, TESTS
TIMEOUT = 300
PREFIX = "ns/fsdpstream/"
KEYS = protocol.StreamKeys(PREFIX)


def write_model(directory: Path) -> None:
    """The built-in tiny Llama, wider and deeper (about 17 MB in float32, 8.5 MB in bfloat16), so that 1 MB
    buckets (the smallest bucketMegabytes) split it into many."""
    from rlkube.core.hf.builtin import char_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    tokenizer = char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 256, 1024, 4
    config.num_attention_heads = config.num_key_value_heads = 8
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))


def next_announcement(client, last_id: str, keys=KEYS) -> tuple[str, dict]:
    return next_weights_ready(client, keys, last_id, TIMEOUT)


def publish_from_ranks(redis_client, redis_server, tmp_path: Path, spec: dict, model: Path,
                       adapters: bool = False) -> tuple[dict, dict, dict]:
    """Two fsdp_publish_worker ranks publish versions 0 (start), 1 (after a step, streamed) and 101 (packed);
    returns ({version: (tensors, receiver's checksum, announced checksum, metadata)}, rank 0's and rank 1's
    reports)."""
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    addr, master = f"127.0.0.1:{free_port()}", free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(master), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        log = open(tmp_path / f"rank-{rank}.log", "wb")
        procs.append((subprocess.Popen(
            [sys.executable, str(SUPPORT / "fsdp_publish_worker.py"), "--spec", str(tmp_path / "spec.json"),
             "--model", str(model), "--addr", addr, "--redis", redis_server.url, "--prefix", PREFIX,
             "--report", str(tmp_path / f"report-{rank}.json")], env=env, stdout=log, stderr=subprocess.STDOUT),
            log))
    rx = WeightReceiver(addr, rank=1, world_size=2, timeout_s=60, local_host="127.0.0.1")
    try:
        last, received = "0-0", {}
        for want in (0, 1, 101):
            last, ann = next_announcement(redis_client, last)
            if rx.epoch != ann["epoch"]:
                rx.join(ann["epoch"])
            version, state = rx.receive(adapters=adapters)
            assert version == ann["version"] == want
            received[version] = ({k: v.clone() for k, v in state.items()}, rx.last_checksum, ann["checksum"],
                                 rx.last_meta)
        for proc, log in procs:
            assert proc.wait(TIMEOUT) == 0, Path(log.name).read_text()[-4000:]
    finally:
        rx.close()
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return (received, json.loads((tmp_path / "report-0.json").read_text()),
            json.loads((tmp_path / "report-1.json").read_text()))


def test_sharded_trainer_streams_the_same_update_as_the_unsharded_path_one_bucket_at_a_time(
        redis_client, redis_server, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_model(model)
    spec = tiny_spec(maxSteps=2, samplesPerStep=4)
    spec["model"]["path"] = str(model)
    spec["trainer"].update(sharding="fsdp", processesPerNode=2,
                           weightTransfer={"dtype": "bfloat16", "bucketMegabytes": 1})
    received, report, other = publish_from_ranks(redis_client, redis_server, tmp_path, spec, model)

    # The same update whichever path sent it: tensors bit for bit, the receiver's checksum exactly, the trainer's
    # announced one (summed from the shards' sums on the sharded path) within the receivers' tolerance.
    streamed, streamed_sum, announced, _ = received[1]
    packed, packed_sum, packed_announced, _ = received[101]
    assert streamed.keys() == packed.keys() and len(streamed) == len(report["packed"]["tensors"])
    for name, tensor in packed.items():
        assert tensor.dtype == torch.bfloat16 and streamed[name].dtype == tensor.dtype, name
        assert torch.equal(streamed[name], tensor), name
    assert streamed_sum == packed_sum
    assert checksums_match(announced, packed_announced)
    assert not torch.equal(received[0][0]["lm_head.weight"], streamed["lm_head.weight"])  # the step changed it
    # The wire metadata is the unsharded path's: names, shapes, dtypes, order and buckets.
    assert report["streamed"]["tensors"] == report["packed"]["tensors"]
    assert report["streamed"]["buckets"] == report["packed"]["buckets"]
    assert len(report["packed"]["buckets"]) >= 6
    assert report["passes"] == other["passes"] == 1  # no retry: every rank ran one pass of gathers

    # Memory: rank 0 held at most one bucket (in the transfer dtype) plus one full float32 tensor being copied in,
    # not the model; the other rank only ever one gathered tensor.
    peak, bucket, largest = report["peak_bytes"], report["bucket_bytes"], report["largest_tensor_bytes"]
    print(f"streamed publish: rank 0 peak {peak} B gathered+buffered (bucket {bucket} B, largest tensor "
          f"{largest} B, model {report['model_bytes']} B in float32); rank 1 peak {other['peak_bytes']} B; "
          f"{len(report['packed']['buckets'])} buckets")
    assert 0 < peak <= bucket + largest
    assert peak < report["model_bytes"] / 4
    assert other["peak_bytes"] <= largest


def test_a_sharded_lora_trainer_streams_the_adapter_alone_to_the_native_engine(redis_client, redis_server,
                                                                              tmp_path):
    """spec.trainer.lora under FSDP with the native engine: the trainer's publications (start_weights,
    publish_weights) stream the adapter alone, kind lora-adapter under PEFT's names, gathered from the shards; the
    receiver (serving adapters) gets exactly the tensors and checksum of rank 0's packed AdapterUpdate."""
    model = builtin_dir()
    spec = tiny_spec(maxSteps=2, samplesPerStep=4)
    spec["model"]["path"] = str(model)
    spec["inference"]["engine"] = "native"
    spec["trainer"].update(sharding="fsdp", processesPerNode=2, weightTransfer={"dtype": "float32"},
                           lora={"rank": 4, "alpha": 8, "targetModules": ["q_proj", "down_proj", "lm_head"]})
    received, report, _ = publish_from_ranks(redis_client, redis_server, tmp_path, spec, model, adapters=True)
    config = lora.wire_config(parse_spec(spec).trainer.lora)
    for version, (tensors, _, _, meta) in received.items():
        assert meta["kind"] == ADAPTER and meta["adapter"] == config, version
        assert lora.pairs(tensors).keys() == {"lm_head.weight"} | {f"model.layers.{i}.{m}.weight" for i in (0, 1)
                                                                   for m in ("self_attn.q_proj", "mlp.down_proj")}
    assert report["streamed"]["kind"] == ADAPTER
    start, streamed, packed = (received[v][0] for v in (0, 1, 101))
    assert all(not t.any() for n, t in start.items() if "lora_B" in n)  # PEFT's fresh adapter: B = 0
    assert any(t.any() for n, t in streamed.items() if "lora_B" in n)  # the step trained it
    assert streamed.keys() == packed.keys()
    for name, tensor in packed.items():
        assert torch.equal(streamed[name], tensor), name
    assert received[1][1] == received[101][1]
    assert checksums_match(received[1][2], received[101][2])


def test_a_restarted_inference_server_gets_the_streamed_weights_again_while_the_trainer_waits(
        redis_client, redis_server, tmp_path, roles):
    """The trainer role on 2 FSDP ranks with a weight-update group: the inference server (a WeightReceiver here)
    takes version 0, dies and comes back while the trainer waits for documents (which would only come from it).
    Rank 0 has no snapshot to send from its watchdog; all ranks gather the weights again in a new epoch, the new
    server gets version 0 exactly as the old one did, and training goes on to the end."""
    steps, per_step = 2, 4
    spec = tiny_spec(maxSteps=steps, samplesPerStep=per_step)
    spec["trainer"].update(sharding="fsdp", nodes=2, checkpoint={"intervalSteps": 10, "claimName": "shared"})
    keys = keys_for("fsdprejoin", spec)
    addr, master = f"127.0.0.1:{free_port()}", free_port()
    ranks = [start_trainer(roles, tmp_path, "fsdprejoin", spec, redis_server.url, ckpt_dir=tmp_path / "ckpt",
                           RANK=str(rank), WORLD_SIZE="2", NODE_RANK=str(rank), NNODES="2", LOCAL_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master), **{runtime.ENV_WEIGHT_SYNC: addr})
             for rank in range(2)]
    first = WeightReceiver(addr, rank=1, world_size=2, timeout_s=60, local_host="127.0.0.1")
    second = WeightReceiver(addr, rank=1, world_size=2, timeout_s=60, local_host="127.0.0.1")
    try:
        last, ann = next_announcement(redis_client, "0-0", keys=keys)
        first.join(ann["epoch"])
        version, before = first.receive()
        assert version == 0
        before = {k: v.clone() for k, v in before.items()}
        first.close()  # the server died; its successor finds the epoch formed and asks to rejoin
        with pytest.raises(StaleEpoch):
            second.join(ann["epoch"])
        last, again = next_announcement(redis_client, last, keys=keys)
        assert again["version"] == 0 and again["epoch"] != ann["epoch"]
        second.join(again["epoch"])
        version, state = second.receive()
        assert version == 0 and state.keys() == before.keys()
        assert all(torch.equal(state[k], before[k]) for k in before)
        assert second.last_checksum == first.last_checksum
        add_documents(redis_client, keys, make_documents(steps * per_step, seed=5))
        for step in range(1, steps + 1):
            last, ann = next_announcement(redis_client, last, keys=keys)
            assert ann["version"] == step and ann["epoch"] == again["epoch"]
            assert second.receive()[0] == step
        assert [rank.wait(TIMEOUT) for rank in ranks] == [0, 0], [r.log()[-3000:] for r in ranks]
    finally:
        first.close()
        second.close()
    assert "sending version 0 again (every rank gathers)" in ranks[1].log()
