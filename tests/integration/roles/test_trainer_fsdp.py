"""FSDP2 sharding of the torch backend (spec.trainer.sharding: fsdp) over gloo: real trainer ranks (separate
processes, the trainer's own DataParallel group) train on their shares of each step's documents; the weights equal
single-process training on the union of the documents, a restart from the distributed checkpoint at another world
size still does, and each rank holds a 1/world share of parameters and Adam state."""

from __future__ import annotations

import json
import signal
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.core_roles import (
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
from rlkube.contract import protocol
from rlkube.core.trainer import Trainer
from safetensors.torch import load_file

from support import DIR as SUPPORT, TESTS
TIMEOUT = 300  # several ranks importing torch and transformers at once on a loaded 2-core machine
TOLERANCE = 1e-5  # float32: only the summation order of the gradients differs (reduce-scatter vs one process)


def fsdp_spec(steps: int, per_step: int, dtype: str = "float32") -> dict:
    spec = tiny_spec(maxSteps=steps, samplesPerStep=per_step)
    spec["trainer"]["sharding"] = "fsdp"
    spec["model"]["dtype"] = dtype
    return spec


def run_ranks(tmp: Path, spec: dict, world: int, steps: int, per_step: int, first_step: int = 0) -> list[dict]:
    """`world` trainer ranks (one process each, RANK/WORLD_SIZE/MASTER_* as the operator sets them)."""
    spec_file = tmp / f"spec-{world}-{first_step}.json"
    # one pod's `world` ranks (they share its checkpoint volume, as the sharded checkpoints need)
    spec_file.write_text(json.dumps(dict(spec, trainer={**spec["trainer"], "processesPerNode": world})))
    port = free_port()
    procs, reports = [], []
    for rank in range(world):
        report = tmp / f"report-{world}-{first_step}-{rank}.json"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               # the worker imports the tests' helpers (core_roles and what it imports)
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        log = open(tmp / f"rank-{world}-{first_step}-{rank}.log", "wb")
        procs.append((subprocess.Popen(
            [sys.executable, str(SUPPORT / "fsdp_worker.py"), "--spec", str(spec_file), "--checkpoints",
             str(tmp / "ckpt"), "--first-step", str(first_step), "--steps", str(steps), "--per-step",
             str(per_step), "--report", str(report)], env=env, stdout=log, stderr=subprocess.STDOUT), log))
        reports.append(report)
    try:
        for proc, log in procs:
            code = proc.wait(TIMEOUT)
            assert code == 0, Path(log.name).read_text()[-4000:]
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [json.loads(r.read_text()) for r in reports]


def reference_weights(spec: dict, steps: int, per_step: int):
    """Single-process (unsharded) training on the union: (weights, metrics, initial weights, parameter + Adam
    bytes held by the one process)."""
    one = dict(spec, trainer={**spec["trainer"], "sharding": "none"})
    trainer = Trainer(parse_spec(one))
    docs = make_documents(steps * per_step, seed=5)
    metrics = [trainer.train_step(docs[k * per_step:(k + 1) * per_step]) for k in range(steps)]
    held = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    held += sum(v.numel() * v.element_size() for s in trainer.backend.optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return trainer.model.state_dict(), metrics, Trainer(parse_spec(one)).model.state_dict(), held


def difference(path: Path, want) -> float:
    got = ckpt.load_weights(Path(path))
    assert got.keys() == want.keys()
    return max(float((got[n] - want[n]).abs().max()) for n in want)


def test_fsdp_ranks_equal_single_process_training_and_resume_at_another_world_size(tmp_path):
    """World 2 for 2 steps with 7 documents a step (uneven shares 4 + 3), checkpoint; then world 3 resumes from
    the distributed checkpoint for a third step (shares 3 + 2 + 2); both equal single-process training."""
    per_step = 7
    spec = fsdp_spec(steps=3, per_step=per_step)
    # The world-2 ranks recompute activations in the backward pass (gradientCheckpointing): same numbers.
    recomputing = dict(spec, trainer={**spec["trainer"], "gradientCheckpointing": True})
    first = run_ranks(tmp_path, recomputing, world=2, steps=2, per_step=per_step)
    want, ref_metrics, initial, held = reference_weights(spec, steps=2, per_step=per_step)
    moved = max(float((want[n] - initial[n]).abs().max()) for n in want)
    assert moved > 1e-3, "training did not change the weights: the comparison would prove nothing"
    worst = difference(first[0]["checkpoint"], want)
    print(f"world 2 (gradient checkpointing), 2 steps: largest difference to single-process training {worst:.2e} (moved {moved:.2e})")
    assert worst < TOLERANCE
    for got, ref in zip(first[0]["metrics"], ref_metrics, strict=True):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert (tmp_path / "ckpt" / ckpt.shards_name(2)).is_dir()
    # What rank 0 would publish: every weight, full, equal to the checkpoint's; gathered one tensor at a time.
    published = load_file(str(tmp_path / "report-2-0-0.safetensors"))
    assert published.keys() == want.keys()
    assert max(float((published[n] - want[n]).abs().max()) for n in want) < TOLERANCE
    assert first[0]["largest_gathered"] == max(t.numel() for t in want.values())

    # The resumed ranks run with cpuOffload (FSDP2's CPUOffloadPolicy): on this CPU-only machine nothing moves,
    # so this shows the offloaded code path (host-side optimizer step) trains and resumes exactly.
    offloaded = dict(spec, trainer={**spec["trainer"], "cpuOffload": True})
    second = run_ranks(tmp_path, offloaded, world=3, steps=1, per_step=per_step, first_step=2)
    want3, *_ = reference_weights(spec, steps=3, per_step=per_step)
    worst3 = difference(second[0]["checkpoint"], want3)
    print(f"resumed at world 3 with cpuOffload, step 3: largest difference to single-process training {worst3:.2e}")
    assert worst3 < TOLERANCE

    # Memory: each rank holds about 1/world of the parameters and of Adam's state.

    total = sum(t.numel() * t.element_size() for t in want.values())
    assert held == 3 * total  # world 1 (unsharded): float32 parameters + Adam's two moments
    for world, reports in ((2, first), (3, second)):
        per_rank = [r["bytes"] for r in reports]
        print(f"world {world}: parameter+Adam bytes per rank {[b['parameters'] + b['optimizer'] for b in per_rank]}"
              f" (world 1: {held})")
        assert max(b["parameters"] + b["optimizer"] for b in per_rank) < held / world * 1.2
        assert sum(b["parameters"] for b in per_rank) == total
        assert max(b["parameters"] for b in per_rank) <= total / world * 1.2
        assert sum(b["optimizer"] for b in per_rank) == 2 * total  # Adam's exp_avg and exp_avg_sq



def test_fsdp_bfloat16_compute_stays_close_to_single_process_autocast(tmp_path):
    """model.dtype bfloat16: the layers all-gather bfloat16 copies of the float32 shards and reduce-scatter in
    float32; the single process runs the same layers under bfloat16 autocast. Not bit-equal (the norms' weights are
    bfloat16 under FSDP, float32 under autocast), and Adam turns tiny gradient differences into whole-step weight
    differences (lr x sign), so weights are not compared element-wise: the step-1 loss and gradient norm (same
    weights, bf16 rounding only) and the step-2 ones (after the sharded update) must agree to bf16 accuracy."""
    per_step = 8
    spec = fsdp_spec(steps=2, per_step=per_step, dtype="bfloat16")
    (rank0, _) = run_ranks(tmp_path, spec, world=2, steps=2, per_step=per_step)
    _, ref_metrics, _, _ = reference_weights(spec, steps=2, per_step=per_step)
    for k, (got, ref) in enumerate(zip(rank0["metrics"], ref_metrics, strict=True)):
        print(f"bfloat16 step {k + 1}: loss {got['loss']:.5f} vs {ref['loss']:.5f}, grad norm "
              f"{got['grad_norm']:.4f} vs {ref['grad_norm']:.4f}")
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-2, abs=1e-3)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-2)
        assert got["loss_tokens"] == ref["loss_tokens"]


def role_spec(steps: int, per_step: int) -> dict:
    spec = fsdp_spec(steps=steps, per_step=per_step)
    spec["trainer"]["nodes"] = 2
    spec["trainer"].setdefault("checkpoint", {})["claimName"] = "shared"  # one directory here (ckpt_dir)
    return spec


def start_role_ranks(roles, tmp: Path, job: str, spec: dict, redis_url: str) -> list:
    port = free_port()
    return [start_trainer(roles, tmp, job, spec, redis_url, ckpt_dir=tmp / "ckpt", RANK=str(rank), WORLD_SIZE="2",
                          NODE_RANK=str(rank), NNODES="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port)) for rank in range(2)]


def test_fsdp_trainer_role_stops_both_ranks_on_sigterm_with_a_complete_sharded_checkpoint(
        redis_client, redis_server, tmp_path, roles):
    """SIGTERM to both ranks after step 1 while they wait for documents: both save their shards of the final
    checkpoint (a collective) and exit 0; rank 0 reports training_finished(interrupted) naming it."""
    spec = role_spec(steps=50, per_step=8)
    keys = keys_for("fsdpterm", spec)
    ranks = start_role_ranks(roles, tmp_path, "fsdpterm", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0])
    for rank in ranks:
        rank.proc.send_signal(signal.SIGTERM)
    assert [rank.wait(60) for rank in ranks] == [0, 0], [r.log() for r in ranks]
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["interrupted"] is True and finished.payload["step"] == 1
    assert Path(finished.payload["checkpoint"]).name == ckpt.checkpoint_name(1)
    assert (tmp_path / "ckpt" / ckpt.shards_name(1) / ".metadata").is_file()


def test_fsdp_trainer_role_over_two_ranks_equals_single_process_training(redis_client, redis_server, tmp_path,
                                                                         roles):
    """The trainer role itself (python -m rlkube.core.trainer, one process per rank, Redis documents) with
    sharding fsdp: both ranks gather the published weights and write the checkpoints (one shared directory);
    rank 0 sends and reports. 7 documents a step: shares of 4 and 3."""
    steps, per_step = 3, 7
    spec = role_spec(steps=steps, per_step=per_step)
    keys = keys_for("fsdp", spec)
    docs = make_documents(steps * per_step, seed=5)
    add_documents(redis_client, keys, docs)
    ranks = start_role_ranks(roles, tmp_path, "fsdp", spec, redis_server.url)
    for rank in ranks:
        assert rank.wait(TIMEOUT) == 0, rank.log()
    kinds = [e.type for e in read_events(redis_client, keys)]
    assert kinds.count(protocol.WEIGHTS_READY) == steps + 1, kinds
    assert kinds.count(protocol.METRICS) == steps, kinds
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["step"] == steps and finished.payload["interrupted"] is False
    want, *_ = reference_weights(spec, steps=steps, per_step=per_step)
    worst = difference(finished.payload["checkpoint"], want)
    print(f"trainer role, 2 FSDP ranks, {steps} steps: largest difference to single-process training {worst:.2e}")
    assert worst < TOLERANCE
    assert (tmp_path / "ckpt" / ckpt.shards_name(steps)).is_dir()


def test_fsdp_ranks_announce_again_together_after_redis_lost_its_streams(redis_client, redis_server, tmp_path,
                                                                         roles):
    """A managed Redis restarted empty while both FSDP ranks wait for step 2's documents: the rank that sees it
    first recreates the group (the other may then see nothing); publishing is a collective, so that rank asks all
    ranks (through their store) to publish version 1 again, and training goes on."""
    spec = role_spec(steps=2, per_step=4)
    keys = keys_for("fsdpempty", spec)
    ranks = start_role_ranks(roles, tmp_path, "fsdpempty", spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(4, seed=1))
    wait_for_event(redis_client, keys, protocol.METRICS, TIMEOUT, ranks[0], where=lambda e: e.step == 1)
    redis_client.flushall()
    again = wait_for_event(redis_client, keys, protocol.WEIGHTS_READY, TIMEOUT, ranks[0])
    assert again.payload["version"] == 1 and again.payload["documents_seen"] == 4
    add_documents(redis_client, keys, make_documents(4, seed=2))
    assert [rank.wait(TIMEOUT) for rank in ranks] == [0, 0], [r.log()[-3000:] for r in ranks]
    for rank in ranks:
        assert "sending version 1 again (every rank gathers)" in rank.log(), rank.log()[-3000:]
    (finished,) = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert finished.payload["step"] == 2 and finished.payload["documents_seen"] == 8
