"""examples/tiny-cpu.yaml with `trainer.backend: megatron`, trainer.nodes 2 and tensor parallel 2 through the operator
on the test node agent (docs/design.md §6, the megatron backend): two trainer pods split every layer of the model
(data parallel 1) over gloo, find each other by the operator's headless Service, the tensor-parallel peer trains
the documents rank 0 reads, rank 0 gathers the weights for inference and writes the checkpoints, and the job learns
the task and Succeeds."""

from __future__ import annotations

import pytest
from support.clusterjob import MIN_MARGIN, POD_ORDER, example, run_to_success_and_learn

pytestmark = pytest.mark.megatron

STEPS = 40


def test_megatron_tensor_parallel_2_on_two_trainer_nodes_learns_and_succeeds(job):
    doc = example(**{"spec.trainer.backend": "megatron", "spec.trainer.nodes": 2,
                     "spec.trainer.megatron": {"tensorParallel": 2},
                     "spec.trainer.resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                     "spec.algorithm.maxSteps": STEPS})
    run_to_success_and_learn(job, doc, STEPS, "e2e megatron TP 2 on 2 trainer nodes", MIN_MARGIN)
    for rank in (0, 1):
        log = job.agent.container_log(job.namespace, f"{job.name}-trainer-{rank}")
        assert f"tensor parallel 2 x data parallel 1; this rank is tensor rank {rank} of data rank 0" in log, \
            log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    assert job.order("deletion") == POD_ORDER, job.agent_signals()
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
