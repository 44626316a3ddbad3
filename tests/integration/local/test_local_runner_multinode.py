"""`rlkube local` with spec.trainer.nodes: 2: one trainer process per rank (the torchrun env the operator gives each
trainer pod, MASTER_ADDR 127.0.0.1 and a free MASTER_PORT), the job succeeds, and teardown stops every rank."""

from __future__ import annotations

import time

import yaml
from support.local_cli import start_local, summary_of
from test_local_runner import EXAMPLE, ORDER, _leftovers
from support import specs

STEPS = 6


def test_tiny_job_on_two_trainer_nodes(tmp_path):
    doc = specs.document(**{"spec.trainer.nodes": 2, "spec.trainer.checkpoint.intervalSteps": 3,
                            "spec.algorithm.maxSteps": STEPS})
    manifest = tmp_path / "two-nodes.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = start_local(str(manifest), "--json", "--output-dir", str(out))
    stdout, stderr = proc.communicate(timeout=300)
    print(f"{STEPS} steps on 2 trainer ranks: {time.monotonic() - t0:.1f}s")
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    assert summary["phase"] == "Succeeded" and summary["steps"] == STEPS, summary
    assert summary["teardown"] == ORDER and summary["forced"] == [], summary
    logs = {rank: (out / "logs" / f"trainer-{rank}.log").read_text() for rank in (0, 1)}
    for rank, text in logs.items():
        assert f"rank {rank}/2 joined the data-parallel group" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in logs[1], logs[1][-3000:]
    assert "training finished at step 6 (interrupted=False)" in logs[0], logs[0][-3000:]
    # rank 0 alone checkpoints: every intervalSteps (3) and at the end
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")) == [
        "step-000003", "step-000006"]
    assert not _leftovers(out)


def test_two_local_ranks_in_one_trainer_process(tmp_path):
    """trainer.processesPerNode: 2 on CPU: `rlkube local` starts ONE trainer process (as the operator starts one
    trainer pod), the launcher in it starts ranks 0 and 1 with torchrun's worker env, and the job succeeds."""
    doc = specs.document(**{"spec.trainer.processesPerNode": 2, "spec.trainer.checkpoint.intervalSteps": 3,
                            "spec.algorithm.maxSteps": STEPS})
    manifest = tmp_path / "two-local-ranks.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = start_local(str(manifest), "--json", "--output-dir", str(out))
    stdout, stderr = proc.communicate(timeout=300)
    print(f"{STEPS} steps on 2 local ranks of one trainer process: {time.monotonic() - t0:.1f}s")
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    assert summary["phase"] == "Succeeded" and summary["steps"] == STEPS, summary
    assert summary["teardown"] == ORDER and summary["forced"] == [], summary
    assert sorted(p.name for p in (out / "logs").glob("trainer-*.log")) == ["trainer-0.log"]
    log = (out / "logs" / "trainer-0.log").read_text()
    assert "node 0: started ranks [0, 1]" in log, log[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] " in log and f"rank {rank}/2 joined the data-parallel group" in log, log[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in log, log[-3000:]
    assert "rank 0 exited 0" in log and "rank 1 exited 0" in log and "Traceback" not in log, log[-3000:]
    assert not _leftovers(out)


FSDP_EXAMPLE = EXAMPLE.parent / "tiny-cpu-fsdp.yaml"
MIN_MARGIN = 0.10  # test_local_runner's margin for the same job unsharded; measured here 0.062 -> 0.225


def test_fsdp_job_on_two_trainer_nodes_learns(tmp_path):
    """examples/tiny-cpu-fsdp.yaml on trainer.nodes: 2 (one process per node, the checkpoint directory shared as
    its RWX claim would be): FSDP2 over both ranks, weights streamed to inference bucket by bucket, and the job
    learns the task like the unsharded one."""
    doc = yaml.safe_load(FSDP_EXAMPLE.read_text())
    trainer = doc["spec"]["trainer"]
    assert trainer.pop("processesPerNode") == 2 and trainer["sharding"] == "fsdp"
    trainer["nodes"] = 2
    trainer["checkpoint"]["claimName"] = "shared"
    manifest = tmp_path / "fsdp-two-nodes.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "run"
    t0 = time.monotonic()
    proc = start_local(str(manifest), "--json", "--output-dir", str(out))
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    summary = summary_of(stdout)
    print(f"FSDP on 2 trainer nodes, {summary['steps']} steps: {time.monotonic() - t0:.1f}s; reward "
          f"{summary['reward_first']:.3f} -> {summary['reward_last']:.3f}")
    assert summary["phase"] == "Succeeded" and summary["steps"] == summary["max_steps"] == 40, summary
    assert summary["teardown"] == ORDER and summary["forced"] == [], summary
    assert summary["reward_last"] - summary["reward_first"] >= MIN_MARGIN, summary
    assert summary["reward_last"] >= 2 * summary["reward_first"], summary
    logs = {rank: (out / "logs" / f"trainer-{rank}.log").read_text() for rank in (0, 1)}
    for rank, text in logs.items():
        assert "Traceback" not in text, text[-3000:]
        assert "weights published bucket by bucket" in text, text[-3000:]
    # every rank wrote its shards of the final checkpoint next to rank 0's Hugging Face export
    assert (out / "checkpoints" / "shards-000040" / ".metadata").is_file()
    assert summary["checkpoint"].endswith("step-000040")
    assert not _leftovers(out)
