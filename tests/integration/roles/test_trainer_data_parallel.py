"""Data-parallel trainer (spec.trainer.nodes = 2): two real trainer role processes (RANK 0/1, WORLD_SIZE 2, gloo)
against a real Redis. The result equals single-process training on the union of each step's documents; only rank 0
publishes; SIGTERM stops both ranks after the same step; a rank killed with SIGKILL makes rank 0 fail (exit 1, no
training_finished) within the collective timeout."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.core_roles import (
    Role,
    add_documents,
    free_port,
    keys_for,
    make_documents,
    read_events,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_trainer,
    tiny_spec,
    wait_for_event,
)
from rlkube.lifecycle.validation import parse_spec
from rlkube.core.training import checkpoint as ckpt
from rlkube.contract import protocol, runtime, streams
from rlkube.contract.context import RoleContext
from rlkube.core.trainer import Trainer
from rlkube.core.trainer.parallel import DataParallelGroup
from rlkube.core.trainer.role import TrainerRole
from safetensors.torch import load_file

TIMEOUT = 120  # two trainer processes importing torch and transformers at once on a loaded 2-core machine
GRACE = 10  # well inside the trainer's default teardown grace period (30 s)
NODES = 2


def dp_spec(**algorithm) -> dict:
    spec = tiny_spec(**algorithm)
    spec["trainer"]["nodes"] = NODES
    return spec


def start_ranks(roles, tmp: Path, job: str, spec: dict, redis_url: str, fresh_rank_1: bool = False,
                **env: str) -> list[Role]:
    """One trainer process per rank with the env the operator gives each trainer pod; rank r checkpoints to
    tmp/ckpt-r (only rank 0 may write there), rank 1 to a new empty directory with `fresh_rank_1`. Each rank has
    a model cache of its own, empty at first, as each trainer pod has (an emptyDir): every rank writes the
    built-in model itself, after it joined the group (transformers' save_pretrained writes on rank 0 only)."""
    port = free_port()
    dirs = {0: tmp / "ckpt-0", 1: tmp / ("ckpt-1-fresh" if fresh_rank_1 else "ckpt-1")}
    return [start_trainer(roles, tmp, job, spec, redis_url, ckpt_dir=dirs[rank], **rank_env(rank, port),
                          **{runtime.ENV_MODEL_CACHE: str(tmp / f"model-cache-{rank}-{job}")}, **env)
            for rank in range(NODES)]


def rank_env(rank: int, master_port: int) -> dict[str, str]:
    """What the operator sets in trainer pod `rank` (MASTER_ADDR: rank 0's pod; here this machine)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(NODES), "NODE_RANK": str(rank), "NNODES": str(NODES),
            "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}


@pytest.mark.parametrize("per_step", [8, 7], ids=["even", "uneven"])
def test_two_ranks_equal_single_process_training_on_the_union(redis_client, redis_server, tmp_path, roles,
                                                              per_step):
    """7 documents per step: rank shares of 4 and 3 (normalised by the global loss-token count, still exact)."""
    steps = 3
    spec = dp_spec(maxSteps=steps, samplesPerStep=per_step)
    keys = keys_for("dp", spec)
    docs = make_documents(steps * per_step, seed=5)
    # Written before the ranks start: each rank takes exactly its share of each step and cannot read for step k+1
    # before both finished step k (the gradient all_reduce), so step k trains on the stream's next `per_step`
    # entries, in whichever split between the two consumers (one XREADGROUP each: even shares always split the same
    # way, so the float summation order and the result are the same every run).
    add_documents(redis_client, keys, docs)
    t0 = time.monotonic()
    ranks = start_ranks(roles, tmp_path, "dp", spec, redis_server.url)
    for rank in ranks:
        assert rank.wait(TIMEOUT) == 0, rank.log()
    print(f"2 ranks, {steps} steps: {time.monotonic() - t0:.1f}s including start-up")

    # Only rank 0 published: one of each event per step, no duplicates.
    events = read_events(redis_client, keys)
    kinds = [e.type for e in events]
    assert kinds.count(protocol.WEIGHTS_READY) == steps + 1, kinds
    assert kinds.count(protocol.METRICS) == steps, kinds
    assert kinds.count(protocol.TRAINING_FINISHED) == 1, kinds
    assert kinds.count(protocol.CHECKPOINT_SAVED) == 1, kinds  # intervalSteps 10 > 3: the final one only
    finished = events[-1]
    assert finished.type == protocol.TRAINING_FINISHED
    assert finished.payload["step"] == steps and finished.payload["interrupted"] is False
    assert finished.payload["documents_seen"] == steps * per_step
    assert not (tmp_path / "ckpt-1").exists() or not any((tmp_path / "ckpt-1").iterdir())
    # Each rank read as its own consumer of the documents group (docs/design.md §5.4).
    consumers = {protocol.text(c["name"]) for c in redis_client.xinfo_consumers(keys.documents,
                                                                                protocol.DOCUMENTS_GROUP)}
    assert consumers == {protocol.consumer_name(0), protocol.consumer_name(1)}

    # The single-process reference on the same per-step groups of documents.
    reference = Trainer(parse_spec(spec))
    ref_metrics = [reference.train_step(docs[k * per_step:(k + 1) * per_step]) for k in range(steps)]
    path = Path(finished.payload["checkpoint"])
    assert path.parent == tmp_path / "ckpt-0"
    got = load_file(str(path / ckpt.MODEL_FILE))
    want = reference.model.state_dict()
    assert got.keys() == want.keys()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    print(f"largest parameter difference to single-process training: {worst:.2e}")
    assert worst < 1e-5
    moved = max(float((want[n] - Trainer(parse_spec(spec)).model.state_dict()[n]).abs().max()) for n in want)
    assert moved > 1e-3, "training did not change the weights: the comparison would prove nothing"
    # The published metrics are of the whole step (both ranks' documents), not rank 0's half.
    metrics = [e.payload for e in events if e.type == protocol.METRICS]
    for k, (m, ref) in enumerate(zip(metrics, ref_metrics, strict=True)):
        step_docs = docs[k * per_step:(k + 1) * per_step]
        assert m["reward_mean"] == pytest.approx(sum(d.reward for d in step_docs) / per_step, abs=1e-12)
        assert m["tokens"] == sum(len(d.tokens) for d in step_docs)
        assert m["documents_seen"] == (k + 1) * per_step
        assert m["loss_tokens"] == ref["loss_tokens"]
        assert m["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert ckpt.read_meta(path).documents_seen == steps * per_step


@pytest.mark.parametrize("signalled", ["both", "rank1"])
def test_sigterm_stops_every_rank_after_the_same_step(redis_client, redis_server, tmp_path, roles, signalled):
    """The operator's teardown signals every trainer pod; a SIGTERM to one rank alone also stops both."""
    spec = dp_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("dpterm", spec)
    ranks = start_ranks(roles, tmp_path, "dpterm", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))  # one step; then both ranks wait for documents
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0])
    t0 = time.monotonic()
    for rank in ranks if signalled == "both" else ranks[1:]:
        rank.proc.send_signal(signal.SIGTERM)
    codes = [rank.wait(GRACE) for rank in ranks]
    took = time.monotonic() - t0
    print(f"SIGTERM to {signalled}: both ranks exited {took:.2f}s later")
    assert codes == [0, 0], [r.log() for r in ranks]
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["interrupted"] is True and finished.payload["step"] == 1
    assert ckpt.read_meta(Path(finished.payload["checkpoint"])).step == 1


def test_a_killed_rank_fails_rank_0_within_the_collective_timeout(redis_client, redis_server, tmp_path, roles):
    timeout_s = 4
    spec = dp_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("dpkill", spec)
    ranks = start_ranks(roles, tmp_path, "dpkill", spec, redis_server.url,
                        RLKUBE_COLLECTIVE_TIMEOUT_S=str(timeout_s))
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0])
    t0 = time.monotonic()
    ranks[1].proc.kill()
    ranks[1].proc.wait(timeout=10)
    # Rank 0 waits for documents when its peer dies; then documents come, as they would from the actors.
    add_documents(redis_client, keys, make_documents(8, seed=1))
    code = ranks[0].wait(timeout_s + GRACE)
    took = time.monotonic() - t0
    print(f"rank 0 exited {code} {took:.2f}s after rank 1 was killed (collective timeout {timeout_s}s)")
    assert code == 1, ranks[0].log()
    assert "trainer rank 1 has shown no sign of life" in ranks[0].log(), ranks[0].log()
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    # the step both ranks completed is kept: a restarted job resumes from it
    saved = read_events(redis_client, keys, protocol.CHECKPOINT_SAVED)
    assert [e.step for e in saved] == [1] and ckpt.read_meta(Path(saved[0].payload["path"])).step == 1


def test_rank_1_fails_when_rank_0_dies(redis_client, redis_server, tmp_path, roles):
    """Rank 0 hosts the rendezvous store: its death is noticed at the next store call."""
    spec = dp_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("dpkill0", spec)
    ranks = start_ranks(roles, tmp_path, "dpkill0", spec, redis_server.url, RLKUBE_COLLECTIVE_TIMEOUT_S="4")
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0])
    ranks[0].proc.kill()
    assert ranks[1].wait(GRACE) == 1, ranks[1].log()
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)


def test_restarted_ranks_resume_from_rank_0s_checkpoint(redis_client, redis_server, tmp_path, roles):
    """Both ranks stopped after step 1 and started again, rank 1 with an empty checkpoint volume (as on a cluster
    without a shared claim): rank 0 loads its checkpoint and broadcasts weights, optimizer state and counters, and
    the finished run still equals uninterrupted single-process training (a rank 1 that kept its fresh Adam state
    would step differently, change the step-3 gradients, and fail the comparison)."""
    steps, per_step = 3, 8
    spec = dp_spec(maxSteps=steps, samplesPerStep=per_step)
    keys = keys_for("dpresume", spec)
    docs = make_documents(steps * per_step, seed=9)
    add_documents(redis_client, keys, docs[:per_step])
    first = start_ranks(roles, tmp_path, "dpresume", spec, redis_server.url)
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, first[0])
    for rank in first:
        rank.proc.send_signal(signal.SIGTERM)
    assert [rank.wait(GRACE) for rank in first] == [0, 0], [r.log() for r in first]
    (stopped,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert stopped.payload["step"] == 1 and stopped.payload["interrupted"] is True
    redis_client.delete(keys.events)
    # rank 1 restarts with a fresh, empty checkpoint directory
    add_documents(redis_client, keys, docs[per_step:])
    second = start_ranks(roles, tmp_path, "dpresume", spec, redis_server.url, fresh_rank_1=True)
    for rank in second:
        assert rank.wait(TIMEOUT) == 0, rank.log()
    assert "resumed from" in second[0].log()
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["step"] == steps and finished.payload["interrupted"] is False
    assert finished.payload["documents_seen"] == steps * per_step
    assert [e.step for e in read_events(redis_client, keys, protocol.METRICS)] == [2, 3]

    reference = Trainer(parse_spec(spec))
    for k in range(steps):
        reference.train_step(docs[k * per_step:(k + 1) * per_step])
    got = load_file(str(Path(finished.payload["checkpoint"]) / ckpt.MODEL_FILE))
    want = reference.model.state_dict()
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    print(f"after a restart at step 1: largest parameter difference to single-process training {worst:.2e}")
    assert worst < 1e-5


def test_a_rank_restarted_alone_fails_both_at_once(redis_client, redis_server, tmp_path, roles):
    """A trainer pod replaced while rank 0 still runs (kill -9, restarted at once): the new rank 1 cannot join
    the running group, and its heartbeat must not keep rank 0 waiting. Both exit 1 well before the (long)
    collective timeout, so that every rank restarts together."""
    spec = dp_spec(maxSteps=50, samplesPerStep=8)
    keys = keys_for("dprestart", spec)
    env = {"RLKUBE_COLLECTIVE_TIMEOUT_S": "60"}
    port = free_port()
    ranks = [start_trainer(roles, tmp_path, "dprestart", spec, redis_server.url, ckpt_dir=tmp_path / f"ckpt-{rank}",
                           **rank_env(rank, port), **env) for rank in range(NODES)]
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0])
    t0 = time.monotonic()
    ranks[1].proc.kill()
    ranks[1].proc.wait(timeout=10)
    again = start_trainer(roles, tmp_path, "dprestart", spec, redis_server.url, ckpt_dir=tmp_path / "ckpt-1",
                          **rank_env(1, port), **env)
    assert again.wait(GRACE + 20) == 1, again.log()
    assert "started again while rank 0" in again.log(), again.log()
    add_documents(redis_client, keys, make_documents(8, seed=1))  # rank 0 gets its share and waits for rank 1
    assert ranks[0].wait(GRACE + 20) == 1, ranks[0].log()
    took = time.monotonic() - t0
    print(f"rank 1 replaced: both exited 1 within {took:.2f}s (collective timeout 60 s)")
    assert took < 40
    assert "trainer rank 1 restarted" in ranks[0].log(), ranks[0].log()
    assert not read_events(redis_client, keys, protocol.TRAINING_FINISHED)


@pytest.mark.parametrize("collective", [False, True], ids=["replicated", "sharded"])
def test_a_lost_group_only_another_rank_saw_still_makes_rank_0_announce_again(redis_client, redis_server,
                                                                              collective):
    """Redis restarted empty while both ranks waited for documents. Rank 1 read first: it saw the group gone and
    created it again, so rank 0's next read finds a group and no sign of the loss. Rank 0 alone announces, so rank
    1 must raise the flag both ranks wait on (this order once left rank 0 waiting for documents that never came)."""
    spec = parse_spec(dp_spec(maxSteps=2, samplesPerStep=4))
    store = torch.distributed.HashStore()  # the group's store, as torch.distributed gives each rank

    def rank(r: int) -> TrainerRole:
        dp = SimpleNamespace(store=store, is_leader=r == 0, data_rank=r, reads_documents=True)
        trainer = SimpleNamespace(parallel=DataParallelGroup(dp), collective=collective, version=1, publisher=None)
        ctx = RoleContext("test", "lostgroup", spec, redis_server.url, index=r)
        return TrainerRole(ctx, redis_server.client(), trainer)

    first, leader = rank(1), rank(0)
    streams.ensure_group(redis_client, first.keys.documents, protocol.DOCUMENTS_GROUP)
    redis_client.flushall()
    assert first.read_documents(2) == []
    assert redis_client.exists(first.keys.documents), "the rank that saw the loss creates the group again"
    assert leader.read_documents(2) == [] and not leader.announce_again  # rank 0 saw nothing itself
    assert first._republish_due(), "rank 1 raises the flag on its next pass through the read loop"
    assert leader._republish_due(), "rank 0 sees it without having seen the loss"
