"""Weight updates over the dedicated gloo group between two real processes, with real Redis announcements.

The trainer side runs in a subprocess (weightsync_peer.py, a WeightPublisher); the inference side is a
WeightReceiver in the test process that follows the announcements on the events stream like the inference
server does. Covered: exact tensors and dtypes per version, the announcement before the transfer, a trainer
killed -9 and restarted on the same port (new epoch), and an inference restart (send failure -> new epoch, and a
late joiner's rejoin request answered by the watchdog).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from rlkube.contract import protocol
from rlkube.core.weights.group import StaleEpoch, WeightReceiver, WeightSyncError
from rlkube.core.weights.wire import checksums_match, weights_checksum
from rlkube.local.ports import free_port

from support import DIR as SUPPORT
from support.trainer_events import next_weights_ready
from support.weightsync_peer import make_weights

PEER = SUPPORT / "weightsync_peer.py"
PREFIX = "ns/job/"
KEYS = protocol.StreamKeys(PREFIX)


@pytest.fixture
def peers(redis_server, tmp_path):
    """Start trainer-side publisher processes; every one is killed at teardown."""
    procs: list[subprocess.Popen] = []

    def start(addr: str, first_version: int, overlap: bool = False, **env: str) -> subprocess.Popen:
        with open(tmp_path / f"peer-{len(procs)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(PEER), addr, "2", redis_server.url, PREFIX, str(first_version)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PEER_OVERLAP": "1" if overlap else "0", **env},
            )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream:
                stream.close()


@pytest.fixture
def receivers():
    made: list[WeightReceiver] = []

    def make(addr: str) -> WeightReceiver:
        r = WeightReceiver(addr, rank=1, world_size=2, timeout_s=20, local_host="127.0.0.1")
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def next_announcement(client, last_id: str, timeout: float = 20.0) -> tuple[str, dict]:
    return next_weights_ready(client, KEYS, last_id, timeout)


def command(proc: subprocess.Popen, version: int) -> None:
    proc.stdin.write(f"{version}\n")
    proc.stdin.flush()


def assert_weights(state: dict[str, torch.Tensor], version: int) -> None:
    expected = make_weights(version)
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


def test_versions_arrive_exactly_in_one_epoch(redis_client, peers, receivers):
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0)
    rx = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    assert ann["version"] == 0 and ann["step"] == 0 and ann["epoch"]
    rx.join(ann["epoch"])
    assert rx.joined
    version, state = rx.receive()
    assert version == 0
    assert_weights(state, 0)
    assert trainer.stdout.readline().strip() == "published 0"
    for v in (1, 2):
        command(trainer, v)
        last, ann = next_announcement(redis_client, last)
        assert (ann["version"], ann["step"], ann["documents_seen"], ann["epoch"]) == (v, v, 4 * v, rx.epoch)
        version, state = rx.receive()
        assert version == v
        assert_weights(state, v)
        assert trainer.stdout.readline().strip() == f"published {v}"


def test_weights_travel_in_the_transfer_dtype_in_buckets_with_a_checksum(redis_client, peers, receivers):
    # bfloat16 transfer, 300-byte buckets: the 16x8 matrix (256 bytes in bfloat16) and the 8-element vector
    # (16 bytes) travel in one bucket; the int64 counter keeps its dtype, in a bucket of its own.
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0, PEER_TRANSFER_DTYPE="bfloat16", PEER_BUCKET_BYTES="300")
    rx = receivers(addr)
    _, ann = next_announcement(redis_client, "0-0")
    rx.join(ann["epoch"])
    version, state = rx.receive()
    assert trainer.stdout.readline().strip() == "published 0"
    expected = make_weights(0)
    assert version == 0 and state.keys() == expected.keys()
    for name, tensor in expected.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert state[name].dtype == want.dtype and torch.equal(state[name], want), name
    # the announcement carries the checksum of what was sent; the receiver verified it on arrival
    want_sum = weights_checksum(expected.items(), torch.bfloat16)
    assert checksums_match(ann["checksum"], want_sum) and checksums_match(rx.last_checksum, want_sum)
    assert not checksums_match(weights_checksum(expected.items()), want_sum)  # float32 values differ


def test_overlapped_transfers_arrive_in_order_after_their_announcements(redis_client, peers, receivers):
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0, overlap=True)
    rx = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    rx.join(ann["epoch"])
    assert rx.receive()[0] == 0
    for v in (1, 2, 3):  # queued back to back: each publish waits only for the previous transfer
        command(trainer, v)
    for v in (1, 2, 3):
        last, ann = next_announcement(redis_client, last)
        assert ann["version"] == v
        version, state = rx.receive()
        assert version == v
        assert_weights(state, v)
    trainer.stdin.close()  # close() waits for the last transfer, then leaves
    assert trainer.wait(timeout=20) == 0
    assert [line.strip() for line in trainer.stdout][-1] == "closed"


def test_restarted_trainer_opens_a_new_epoch_on_the_same_port(redis_client, peers, receivers):
    addr = f"127.0.0.1:{free_port()}"
    first = peers(addr, 0)
    rx = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    old_epoch = ann["epoch"]
    rx.join(old_epoch)
    assert rx.receive()[0] == 0
    command(first, 1)
    last, _ = next_announcement(redis_client, last)
    assert rx.receive()[0] == 1

    first.send_signal(signal.SIGKILL)  # as the chaos test does; the container restarts in place
    first.wait(timeout=10)
    second = peers(addr, 1)  # resumed from its checkpoint at step 1
    last, ann = next_announcement(redis_client, last)
    assert ann["epoch"] != old_epoch and ann["version"] == 1
    with pytest.raises(StaleEpoch):
        rx.join(old_epoch)  # the new trainer's store knows only its own epoch
    rx.join(ann["epoch"])
    version, state = rx.receive()
    assert version == 1
    assert_weights(state, 1)
    command(second, 2)
    last, ann = next_announcement(redis_client, last)
    version, state = rx.receive()
    assert (version, ann["epoch"]) == (2, rx.epoch)
    assert_weights(state, 2)


def test_dead_inference_makes_the_next_publish_reopen(redis_client, peers, receivers):
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0)
    old = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    old.join(ann["epoch"])
    assert old.receive()[0] == 0
    old.close()  # aborting the group closes its connections, as a killed process does

    command(trainer, 1)  # this transfer fails, the publisher opens a new epoch and announces it again
    last, first_try = next_announcement(redis_client, last)
    assert first_try["epoch"] == ann["epoch"] and first_try["version"] == 1
    last, retry = next_announcement(redis_client, last)
    assert retry["epoch"] != ann["epoch"] and retry["version"] == 1
    new = receivers(addr)
    new.join(retry["epoch"])
    version, state = new.receive()
    assert version == 1
    assert_weights(state, 1)
    assert trainer.stdout.readline().strip() == "published 0"
    assert trainer.stdout.readline().strip() == "published 1"


def test_an_announcement_lost_with_the_stream_is_made_again_while_its_transfer_waits(redis_client, peers, receivers):
    """A managed Redis that restarts empty takes the announcement of a running transfer with it: the servers never
    see it, and without a new one the trainer would wait in the broadcast until gloo's timeout."""
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0)
    rx = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    rx.join(ann["epoch"])
    assert rx.receive()[0] == 0
    assert trainer.stdout.readline().strip() == "published 0"

    command(trainer, 1)
    lost_id, lost = next_announcement(redis_client, last)
    assert lost["version"] == 1
    redis_client.flushall()  # what the servers would find after a restart: nothing
    again_id, again = next_announcement(redis_client, "0-0", timeout=10)
    assert again == lost and again_id != lost_id  # the same epoch and version, announced anew
    version, state = rx.receive()  # the receiver joins the transfer that was waiting all along
    assert version == 1
    assert_weights(state, 1)
    assert trainer.stdout.readline().strip() == "published 1"


def test_late_joiner_asks_for_a_new_epoch_and_gets_the_last_weights(redis_client, peers, receivers):
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0)
    old = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    old.join(ann["epoch"])
    old.receive()
    command(trainer, 3)
    last, _ = next_announcement(redis_client, last)
    assert old.receive()[0] == 3
    old.close()  # the server restarts between two training steps; no publish() is coming to notice it

    restarted = receivers(addr)
    with pytest.raises(StaleEpoch):
        restarted.join(ann["epoch"])  # formed without it: files a rejoin request
    last, again = next_announcement(redis_client, last)
    assert again["epoch"] != ann["epoch"] and again["version"] == 3
    restarted.join(again["epoch"])
    version, state = restarted.receive()
    assert version == 3
    assert_weights(state, 3)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="host:port"):
        WeightReceiver("nohost", rank=1, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        WeightReceiver("127.0.0.1:1", rank=0, world_size=2)
    with pytest.raises(ValueError, match="backend"):
        WeightReceiver("127.0.0.1:1", rank=1, world_size=2, backend="mpi")


def test_unreachable_store_is_a_weightsync_error():
    rx = WeightReceiver(f"127.0.0.1:{free_port()}", rank=1, world_size=2, timeout_s=1)
    with pytest.raises(WeightSyncError, match="cannot reach"):
        rx.join("some-epoch")


@pytest.mark.skipif(torch.distributed.is_nccl_available(), reason="this torch build has NCCL")
def test_nccl_without_cuda_build_is_a_clear_error():
    with pytest.raises(ValueError, match="nccl"):
        WeightReceiver("127.0.0.1:1", rank=1, world_size=2, backend="nccl")


@pytest.mark.parametrize("bucket_bytes", ["4096", "300"], ids=["one-bucket", "per-tensor-buckets"])
def test_a_streamed_receive_loads_no_bucket_that_fails_its_checksum(redis_client, peers, receivers, bucket_bytes):
    # The peer corrupts one value of version 1's first bucket after taking the checksums: the streamed receive
    # checks a bucket before the engine sees any of it, so nothing of version 1 is loaded; the rest of the update
    # is received and dropped (the trainer's send completes) and version 2 arrives whole in a new epoch.
    addr = f"127.0.0.1:{free_port()}"
    trainer = peers(addr, 0, PEER_CORRUPT_VERSIONS="1", PEER_BUCKET_BYTES=bucket_bytes)
    rx = receivers(addr)
    last, ann = next_announcement(redis_client, "0-0")
    rx.join(ann["epoch"])
    got: dict[str, torch.Tensor] = {}

    def load(stream):
        got.update((n, t.clone()) for n, t in stream)

    assert rx.receive_streamed(load, reuse=True) == 0
    assert_weights(got, 0)
    assert trainer.stdout.readline().strip() == "published 0"
    command(trainer, 1)
    last, ann = next_announcement(redis_client, last)
    calls: list[str] = []
    with pytest.raises(WeightSyncError, match="checksum"):
        rx.receive_streamed(lambda stream: calls.append("load"))
    assert calls == [] and not rx.joined
    assert trainer.stdout.readline().strip() == "published 1"  # the trainer's send of version 1 completed
    left = ann["epoch"]
    command(trainer, 2)  # announced in the epoch we left, then (its send failing) again in a new one
    last, ann = next_announcement(redis_client, last)
    while ann["version"] != 2 or ann["epoch"] == left:
        last, ann = next_announcement(redis_client, last)
    rx.join(ann["epoch"])
    got.clear()
    assert rx.receive_streamed(load) == 2
    assert_weights(got, 2)
