"""examples/tiny-cpu-fsdp.yaml through the operator on the test node agent, on trainer.nodes: 2 (issue 10, must-show
3): two trainer pods, one FSDP2 rank each over gloo, find each other by the operator's headless Service, write their
shards of every checkpoint to one ReadWriteMany claim (the node agent maps it to one host directory), stream the
weights to inference bucket by bucket, and the job learns the task and Succeeds."""

from __future__ import annotations

import yaml
from clusterjob import FULL_ORDER, MIN_MARGIN, ROOT, run_to_success_and_learn
from test_bad_inputs import claim_dir

STEPS = 40


def test_fsdp_on_two_trainer_nodes_learns_and_succeeds(job, core_api, node_agent, namespace):
    shared = claim_dir(core_api, node_agent, namespace, "checkpoints")
    doc = yaml.safe_load((ROOT / "examples" / "tiny-cpu-fsdp.yaml").read_text())
    trainer = doc["spec"]["trainer"]
    trainer.pop("processesPerNode")
    trainer.update(nodes=2, resources={"requests": {"cpu": "1", "memory": "1Gi"}})
    trainer["checkpoint"]["claimName"] = "checkpoints"
    run_to_success_and_learn(job, doc, STEPS, "e2e FSDP on 2 trainer nodes", MIN_MARGIN)
    for rank in (0, 1):
        log = job.agent.container_log(job.namespace, f"{job.name}-trainer-{rank}")
        assert f"rank {rank}/2 joined the data-parallel group" in log, log[-3000:]
        assert "weights published bucket by bucket" in log and "Traceback" not in log, log[-3000:]
    # both ranks wrote their shards of the final checkpoint to the shared claim, next to rank 0's HF export
    assert list(shared.rglob(f"shards-{STEPS:06d}/.metadata")), sorted(str(p) for p in shared.rglob("*"))[:50]
    assert list(shared.rglob(f"step-{STEPS:06d}/model.safetensors"))
    assert job.order("deletion") == FULL_ORDER, job.agent_signals()
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
