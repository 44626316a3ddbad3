"""`trainer.backend: fast-llm` through the operator (docs/design.md §8), one job per engine (the vLLM one in the
vllm tier: RLKUBE_VLLM_PYTHON, as tests/e2e/node_agent/test_vllm_job.py): the trainer pod runs
the operator's command (rlkube.core.launch.fast_llm -> torchrun -> `fast-llm train gpt --config ...`) where the
image's `fast-llm` is the stand-in (tests/support/fast_llm_stand_in.py, Fast-LLM's Redis and broadcast calls
over gloo; a GPU job's config says NCCL for vLLM, which on CPUs the stand-in and vLLM's worker both replace with
gloo). The inference server joins Fast-LLM's broadcast group at start-up, becomes healthy on the first update,
the actors run, Fast-LLM's `training_finished` ends the job: Succeeded, torn down in order, and the weights served
are the ones broadcast (the server's checksum of each version equals the stand-in's of that step).

How the pods run Fast-LLM's command here: a node agent of this module's own advertises one nvidia.com/gpu
(validation requires GPUs for fast-llm; nothing uses it) and, for an image whose name says `fast-llm`, puts a
directory first on PATH whose `fast-llm` runs the stand-in (tests/nodeagent/agent.py image_env), as that image's
`fast-llm` would be Fast-LLM.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from support.clusterjob import FULL_ORDER, POD_ORDER, example, stage_names
from support import DIR as SUPPORT
from support.hf_models import write_tiny_model
from nodeagent.harness import AgentProcess

STAND_IN = SUPPORT / "fast_llm_stand_in.py"
STEPS, PER_STEP, OVERSHOOT = 3, 8, 1
AGENT_LABEL = "rlkube.io/node-agent"  # tests/e2e/node_agent/conftest.py
GPU_TOKEN = f"gpu-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def fast_llm_bin():
    """What a trainer-fast-llm image has on PATH as `fast-llm`: here the stand-in, overshooting docs_per_step by
    one document a step as Fast-LLM does when it fills its last micro-batch."""
    bin_dir = Path(tempfile.mkdtemp(prefix="rlkube-e2e-fast-llm-bin-", dir="/var/tmp"))  # /tmp: a pod's emptyDir
    bin_dir.chmod(0o755)
    program = bin_dir / "fast-llm"
    # A test may add arguments for the stand-in in `extra-args` (one run of the module at a time).
    program.write_text(f'#!/bin/sh\nexec python {STAND_IN} "$@" --overshoot {OVERSHOOT} '
                       f'$(cat {bin_dir}/extra-args 2>/dev/null)\n')
    program.chmod(0o755)
    yield bin_dir
    shutil.rmtree(bin_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def node_agent(cluster, tmp_path_factory, fast_llm_bin):
    """This module's node: one advertised GPU and the Fast-LLM image's `fast-llm`; it serves only namespaces
    labelled with its own token, so the session's agent never competes for these pods."""
    agent = AgentProcess(cluster, tmp_path_factory.mktemp("gpu-node-agent"),
                         namespace_selector=f"{AGENT_LABEL}={GPU_TOKEN}", extra_args=("--gpus", "1"),
                         env={"NODEAGENT_FAST_LLM_BIN": str(fast_llm_bin)}).start()
    yield agent
    agent.stop_leaving_nothing()


@pytest.fixture
def namespace(namespace, api_client, node_agent):
    from kubernetes import client

    client.CoreV1Api(api_client).patch_namespace(namespace, {"metadata": {"labels": {AGENT_LABEL: GPU_TOKEN}}})
    return namespace


@pytest.fixture
def model_dir():
    """A tied-embedding Qwen2 checkpoint in a host directory the pods see (not under /tmp: an emptyDir in a pod)."""
    path = Path(tempfile.mkdtemp(prefix="rlkube-e2e-fast-llm-", dir="/var/tmp"))
    path.chmod(0o755)
    yield write_tiny_model(path / "qwen2", "qwen2", "bpe", seed=3)
    shutil.rmtree(path, ignore_errors=True)


def checksums(log: str, pattern: str) -> dict[int, float]:
    return {int(step): float(value) for step, value in re.findall(pattern, log)}


VLLM_PYTHON = os.environ.get("RLKUBE_VLLM_PYTHON", "")
ENGINES = [
    pytest.param("native", id="native"),
    pytest.param("vllm", id="vllm", marks=[
        pytest.mark.vllm,
        pytest.mark.skipif(not VLLM_PYTHON or not os.access(VLLM_PYTHON, os.X_OK),
                           reason="RLKUBE_VLLM_PYTHON does not name the vLLM environment (`make deps-vllm`)")]),
]
VLLM = {
    "spec.inference.engine": "vllm",
    "spec.inference.image": "ghcr.io/rlkube/vllm:0.1.0-cpu",
    "spec.runPolicy.eventTimeoutSeconds": 600,
    "spec.teardown.gracePeriodSeconds.inference": 30,
}
JOINED = {"native": "joined Fast-LLM's weight broadcast as rank 1 of 2",
          "vllm": "joined Fast-LLM's weight broadcast as ranks [1] of 2"}


def fast_llm_overrides(model_dir, steps: int) -> dict:
    """A fast-llm job of `steps` steps on the test's Qwen2 model, run by the trainer-fast-llm image."""
    return {
        "spec.model.path": str(model_dir),
        "spec.model.maxSequenceLength": 64,
        "spec.algorithm.maxSteps": steps,
        "spec.algorithm.samplesPerStep": PER_STEP,
        "spec.algorithm.groupSize": 4,
        "spec.trainer.backend": "fast-llm",
        "spec.trainer.image": "ghcr.io/rlkube/trainer-fast-llm:0.1.0",
        "spec.trainer.gpusPerNode": 1,
        "spec.trainer.fastLlm": {"modelFormat": "qwen2"},
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_fast_llm_job_receives_the_broadcast_and_succeeds(job, model_dir, engine):
    job.apply(example(**(VLLM if engine == "vllm" else {}), **fast_llm_overrides(model_dir, STEPS)))
    follower = job.follow()
    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["reason"] == "TrainingFinished"
    assert st["completion"]["finalStep"] == STEPS and st["completion"]["trainerExitCode"] == 0, st["completion"]

    trainer_log = job.agent.container_log(job.namespace, f"{job.name}-trainer-0")
    inference_log = job.agent.container_log(job.namespace, f"{job.name}-inference-0")
    assert "stand-in: broadcast group formed" in trainer_log and "stand-in: broadcast done" in trainer_log, \
        trainer_log[-3000:]
    assert JOINED[engine] in inference_log, inference_log[-3000:]
    sent = checksums(trainer_log, r"stand-in: checksum (\d+) (\S+)")
    served = checksums(inference_log, r"weights version (\d+) in effect \(checksum (\S+?),")
    assert sorted(sent) == list(range(STEPS + 1)), trainer_log[-3000:]
    # Every update was served, each exactly as broadcast (the tied output weight restored from the embedding).
    assert sorted(served) == sorted(sent), inference_log[-3000:]
    for step, value in sent.items():
        assert abs(served[step] - value) <= 1e-9 * max(1.0, abs(value)), (step, served[step], value)

    # The actors ran: the trainer read every document it counted, docs_per_step + the overshoot each step.
    follower.stop()
    assert follower.finished is not None, follower.describe()
    assert [p.get("documents_seen") for p in follower.weights_ready] == \
        [i * (PER_STEP + OVERSHOOT) for i in range(STEPS + 1)], follower.describe()

    assert stage_names(st) == FULL_ORDER and job.order("deletion") == POD_ORDER, job.agent_signals()
    assert not job.agent_signals("SIGKILL"), "a pod needed SIGKILL in a clean run"
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []


KILLED_AFTER, RESTART_STEPS = 2, 4
FAST_LLM_DEFAULT_TIMEOUT_S = 600
"""Fast-LLM's RedisConfig.timeout default, its broadcast group's timeout when nothing sets it (and the stand-in's
rendezvous timeout here): a restarted trainer whose receivers never rejoin fails after it."""


def test_a_fast_llm_trainer_killed_between_updates_resumes_and_the_job_succeeds(job, model_dir, fast_llm_bin):
    """The trainer container is SIGKILLed between updates: once step KILLED_AFTER was broadcast, served and
    checkpointed, the stand-in holds where Fast-LLM waits for the next step's documents (`--pause-after-step`, in
    a run that resumed nothing) and is killed there; its emptyDir checkpoint survives the in-place restart. The
    restarted launcher opens a new broadcast store and announces it; the inference server joins the new group
    at once (no failed transfer is needed), Fast-LLM resumes from its checkpoint, and the job Succeeds long before
    the broadcast timeout would have ended a trainer left alone in its group, with every step after the checkpoint
    trained exactly once."""
    extra = fast_llm_bin / "extra-args"
    extra.write_text(f"--pause-after-step {KILLED_AFTER}\n")
    try:
        _kill_between_updates_and_succeed(job, model_dir)
    finally:
        extra.unlink(missing_ok=True)


def _kill_between_updates_and_succeed(job, model_dir) -> None:
    job.apply(example(**fast_llm_overrides(model_dir, RESTART_STEPS), **{
        "spec.trainer.checkpoint": {"intervalSteps": 1},
        "spec.runPolicy.backoffLimit": 3,
    }))
    follower = job.follow()
    trainer_pod, inference_pod = f"{job.name}-trainer-0", f"{job.name}-inference-0"
    job.wait(lambda _: f"stand-in: paused after step {KILLED_AFTER}" in job.agent.container_log(job.namespace,
                                                                                                trainer_pod)
             and f"weights version {KILLED_AFTER} in effect" in job.agent.container_log(job.namespace, inference_pod),
             600, f"step {KILLED_AFTER} checkpointed and served, the trainer held before the next")
    os.killpg(job.pid("trainer"), signal.SIGKILL)  # launcher, torchrun and Fast-LLM at once
    killed_at = time.monotonic()

    tj = job.wait_phase(("Succeeded", "Failed"), 900)
    took = time.monotonic() - killed_at
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == RESTART_STEPS and st["completion"]["trainerExitCode"] == 0, st["completion"]
    assert st["components"]["trainer"]["restarts"] == 1, st["components"]
    print(f"\nkilled after step {KILLED_AFTER}; Succeeded {took:.0f}s later")
    assert took < FAST_LLM_DEFAULT_TIMEOUT_S, took

    trainer_log = job.agent.container_log(job.namespace, trainer_pod)
    inference_log = job.agent.container_log(job.namespace, inference_pod)
    runs = re.split(r"==> trainer/\d+\.log <==", trainer_log)[1:]  # the container's first run, then its restart
    assert len(runs) == 2, trainer_log[-3000:]
    (resumed,) = [int(s) for s in re.findall(r"stand-in: resumed from checkpoint (\d+)", runs[1])]
    assert resumed == KILLED_AFTER, runs[1][-3000:]
    trained = [[int(step) for step in re.findall(r"stand-in: trained step (\d+)", run)] for run in runs]
    # Up to the checkpoint in the first run, every later step once in the restart: none lost, none repeated.
    assert trained == [list(range(1, resumed + 1)), list(range(resumed + 1, RESTART_STEPS + 1))], trained
    # Rejoined on the launcher's announcement: no transfer failed (none was under way when the trainer died).
    assert "Fast-LLM's trainer opened broadcast generation" in inference_log, inference_log[-3000:]
    assert "refused" not in inference_log, inference_log[-3000:]
    served = checksums(inference_log, r"weights version (\d+) in effect \(checksum (\S+?),")
    sent = checksums(trainer_log, r"stand-in: checksum (\d+) (\S+)")
    assert abs(served[RESTART_STEPS] - sent[RESTART_STEPS]) <= 1e-9 * max(1.0, abs(sent[RESTART_STEPS]))
    follower.stop()
    steps = [p["step"] for p in follower.weights_ready]
    # The first run's updates, then the restart's: run_begin at the resumed step and each later step once.
    assert steps == list(range(resumed + 1)) + list(range(resumed, RESTART_STEPS + 1)), follower.describe()
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    assert job.leftover_processes() == []
