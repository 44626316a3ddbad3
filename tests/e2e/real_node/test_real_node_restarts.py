"""Trainer restarts on the real node (kubelet + containerd, the operator installed by its chart), where what is
under test is how the operator and the trainer meet the kubelet's own handling of a killed container: a trainer pod
the kubelet reports failed (restartPolicy Never) and the operator recreates, resuming from its checkpoint claim or,
on an emptyDir, failing the job naming the field that would have kept it; and a data-parallel rank killed, the
kubelet restarting both ranks in place together. Moved here from the node agent (tests/nodeagent's docstring lists
what stays there).

Containers are killed and frozen through containerd (`ctr task kill`), as in
tests/e2e/real_node/test_real_node_failures.py, whose short job and end checks these share. Each job costs about a
minute here (pods in containers on 2 shared CPUs).
"""

from __future__ import annotations

import re

import pytest
from support.realnode import ContainerExits, ContainerRuns, PodWatch, RealJob, hostpath_claim
from test_real_node_failures import TERMINAL, assert_clean_end, assert_succeeded_with_every_step, chaos_example
from support.waiting import wait_for


# Long enough that the job still runs when the kill comes: the trainer is killed only once the status names a
# checkpoint, and 25 steps (the failure tests' count) were all trained by then once, on a quiet machine.
MAX_STEPS = 60


def restart_example(**overrides) -> dict:
    return chaos_example(**{"spec.algorithm.maxSteps": MAX_STEPS, **overrides})


@pytest.fixture
def job(real_job):
    return real_job


@pytest.fixture
def started():
    """start(thread) starts a watch or log reader of this test and returns it; whatever still runs at the test's
    end is stopped (a `ctr events` process among them)."""
    threads = []

    def start(thread):
        thread.start()
        threads.append(thread)
        return thread

    yield start
    for t in threads:
        t.stop()


def assert_every_step_trained(job: RealJob, tj: dict) -> None:
    """Succeeded at the last step, and every step's metrics were published (a resumed trainer repeats some)."""
    assert_succeeded_with_every_step(job, tj, MAX_STEPS)
    assert tj["status"]["trainer"]["step"] == MAX_STEPS, tj["status"]["trainer"]
    steps = [m["step"] for m in job.follower.metrics]
    assert set(steps) == set(range(1, MAX_STEPS + 1)), steps


def kill_mid_run(job: RealJob, node, role: str, index: int = 0, before=None) -> None:
    """kill -9 of the role's container, with the actor frozen (SIGSTOP) from before `before()` (what must hold
    when the kill comes) until after the kill, so the job is surely mid-run when the container dies."""
    actor = job.container("actor")
    node.ctr("tasks", "kill", "--signal", "SIGSTOP", actor)
    try:
        if before is not None:
            before()
        node.ctr("tasks", "kill", "--signal", "SIGKILL", job.container(role, index))
    finally:
        node.ctr("tasks", "kill", "--signal", "SIGCONT", actor)


def wait_end(job: RealJob, timeout: float, *threads) -> dict:
    """The job once Succeeded or Failed and every child of it gone; then `threads` (watches, log readers) stopped:
    the containers have ended, so every log has been read to its end (stopping twice is harmless)."""
    tj = job.wait_phase(TERMINAL, timeout)
    wait_for(lambda: not job.children_left(), 120,
             lambda: f"children removed: {job.children_left()}\n{job.diagnostics()}")
    for t in threads:
        t.stop()
    return tj


@pytest.mark.parametrize("claim", [None, "checkpoints"], ids=["emptyDir", "claim"])
def test_a_recreated_trainer_pod_resumes_from_its_claim_or_fails_naming_it(job, real_node, real_api, started,
                                                                            claim):
    """restartPolicy.trainer Never: kill -9 of the trainer's container after a checkpoint the status names; the
    kubelet reports it failed (exit 137, not restarted) and the operator replaces its pod. On a claim (a hostPath
    PersistentVolume) the new pod resumes from it and the job succeeds with every step; on the default emptyDir
    the new pod finds no checkpoint where its resume annotation names one, and the job fails at once
    (CheckpointLost, naming spec.trainer.checkpoint.claimName) instead of training again from step 0."""
    overrides = {"spec.runPolicy.restartPolicy": {"trainer": "Never"}}
    if claim:
        hostpath_claim(job.core, real_node, job.namespace, claim)
        overrides["spec.trainer.checkpoint.claimName"] = claim
    pods = started(PodWatch(real_api, job.namespace))
    exits = started(ContainerExits(real_node))
    job.apply(restart_example(**overrides))
    trainer = started(ContainerRuns(job.namespace, job.pod("trainer"), "trainer"))
    job.follow()
    wait_for(lambda: job.follower.checkpoints, 300,
             lambda: f"a first checkpoint: {job.follower.describe()}\n{job.diagnostics()}", 0.1)
    saved = {}

    def checkpoint_in_status():
        # The operator writes the replacement pod's resume annotation from the status: the kill comes after it.
        saved.update(wait_for(lambda: (job.status().get("trainer") or {}).get("lastCheckpoint"), 60,
                              lambda: f"status.trainer.lastCheckpoint: {job.status()}", 0.1))

    kill_mid_run(job, real_node, "trainer", before=checkpoint_in_status)
    tj = wait_end(job, 300, pods, exits, trainer)

    st = tj["status"]
    name = job.pod("trainer")
    old_uid, new_uid = pods.uids[name]  # recreated, not restarted in place
    # One run in each pod, as containerd saw them end: the SIGKILL, then on the emptyDir exit 78 (a configuration
    # error) within seconds of its start, on the claim 0 at the last step.
    (killed,), (new_run,) = pods.uids[name][old_uid]["trainer"], pods.uids[name][new_uid]["trainer"]
    assert (exits.status.get(killed), exits.status.get(new_run)) == (137, 78 if claim is None else 0), (
        exits.status, pods.uids)
    assert [(r.pod_uid, r.restart) for r in trainer.runs] == [(old_uid, 0), (new_uid, 0)], trainer.describe()
    log = trainer.runs[1].log
    warned = [e for e in job.core.list_namespaced_event(job.namespace).items if e.reason == "EphemeralCheckpoints"]
    print(f"\ntrainer pod recreated after checkpoint step {saved['step']} ({claim or 'emptyDir'}): {st['phase']} "
          f"({st.get('reason')}: {st.get('message')})")
    if claim is None:
        assert st["phase"] == "Failed" and st["reason"] == "CheckpointLost", job.diagnostics()
        m = re.search(r"spec\.trainer\.checkpoint\.claimName: checkpoint lost: the checkpoint at (\S+) step (\d+) "
                      r"is gone", st["message"])
        assert m and int(m.group(2)) >= saved["step"], st["message"]
        assert "resumed from" not in log and "checkpoint lost" in log, log[-3000:]
        steps = [m["step"] for m in job.follower.metrics]
        assert steps.count(1) == 1, steps  # the recreated trainer never trained a step again from the start
        assert [e.type for e in warned] == ["Warning"], warned  # once, at creation
    else:
        assert_every_step_trained(job, tj)
        m = re.search(r"resumed from \S+ \(step (\d+)", log)
        assert m and saved["step"] <= int(m.group(1)) < MAX_STEPS, log[-3000:]
        assert st["components"]["trainer"]["restarts"] == 1, st["components"]
        assert warned == []
    assert_clean_end(job, st)


def test_a_data_parallel_rank_killed_mid_run_restarts_the_ranks_together(job, real_node, real_api, started):
    """trainer.nodes 2, kill -9 of rank 1's container after a first checkpoint: the kubelet restarts it in place,
    the restarted rank finds rank 0 still in the old group, both fail and the kubelet restarts both in place (no
    pod recreated); rank 0 resumes from its checkpoint and hands its state to rank 1, and the job succeeds with
    every step. Requests lowered so two trainers fit this 2-CPU node beside inference (as in
    tests/e2e/real_node/test_real_node_pods.py)."""
    backoff = 4
    pods = started(PodWatch(real_api, job.namespace))
    job.apply(restart_example(**{"spec.trainer.nodes": 2, "spec.runPolicy.backoffLimit": backoff,
                               "spec.trainer.resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}))
    rank0 = started(ContainerRuns(job.namespace, job.pod("trainer", 0), "trainer"))
    job.follow()
    wait_for(lambda: job.follower.checkpoints, 300,
             lambda: f"a first checkpoint: {job.follower.describe()}\n{job.diagnostics()}", 0.1)
    saved = []
    kill_mid_run(job, real_node, "trainer", 1, before=lambda: saved.append(max(job.follower.checkpoints)))
    tj = wait_end(job, 420, pods, rank0)

    st = tj["status"]
    ranks = [job.pod("trainer", 0), job.pod("trainer", 1)]
    print(f"\nrank 1 killed after checkpoint {saved[0]}: trainer restarts {st['components']['trainer']['restarts']}, "
          f"in place per pod {[pods.restarts.get(p) for p in ranks]}")
    assert_every_step_trained(job, tj)
    assert 1 <= st["components"]["trainer"]["restarts"] <= backoff, st["components"]
    assert all(len(pods.uids[p]) == 1 and pods.restarts[p] >= 1 for p in ranks), (pods.uids, pods.restarts)
    m = re.search(r"resumed from \S+ \(step (\d+)", rank0.runs[-1].log)  # the run that finished the job
    assert len(rank0.runs) >= 2 and m and saved[0] <= int(m.group(1)) < MAX_STEPS, rank0.describe()
    assert_clean_end(job, st)
