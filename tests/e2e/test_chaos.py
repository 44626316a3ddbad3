"""Chaos on a running TrainingJob that stays on the test node agent (tests/nodeagent; its docstring says why):
the operator killed with -9 mid-run and again during teardown, the operator away while training finishes (both
need an operator process the test stops and starts at instants shorter than a pod's start); and, not moved yet
though the real node could run them, a data-parallel rank killed and a trainer pod recreated with or without its
checkpoint claim.
Each test ends with a status that tells the truth and no process left.

The kills the real kubelet shows for real run on the real node: tests/e2e/test_real_cluster.py (the trainer killed,
restarted in place, resuming from its claim; the operator's pod killed) and tests/e2e/test_real_node_failures.py
(the actor and Redis killed, a pod ignoring SIGTERM, the job deleted mid-run).

A shorter copy of examples/tiny-cpu.yaml keeps them quick: a checkpoint every 5 steps, short grace periods.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from clusterjob import FULL_ORDER, example, stage_names
from nodeagent.harness import wait_for
from test_bad_inputs import claim_dir

MAX_STEPS = 60  # long enough that the job is still running when a test acts at step 3, even under load
MID_RUN_STEPS = 100  # the operator-restart test needs the job still mid-run when the operator is back
TERMINAL = ("Succeeded", "Failed")


def chaos_example(**overrides) -> dict:
    return example(**{
        "spec.algorithm.maxSteps": MAX_STEPS,
        "spec.trainer.checkpoint.intervalSteps": 5,
        "spec.runPolicy.completionTimeoutSeconds": 30,
        "spec.runPolicy.eventTimeoutSeconds": 60,
        "spec.teardown.gracePeriodSeconds": {"actor": 3, "preprocessor": 3, "inference": 3, "trainer": 10, "redis": 3},
        **overrides,
    })


def assert_succeeded_with_every_step(job, tj: dict, steps: int = MAX_STEPS) -> None:
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["completion"]["trainerExitCode"] == 0, st["completion"]
    assert st["trainer"]["step"] == steps


def teardown_order(job) -> list[str]:
    """Roles in the order the node agent saw the deletion of each pod's LAST incarnation: a pod replaced
    mid-run (a chaos test may legitimately cause that) was deleted before the teardown, not during it."""
    last = {s["pod"]: s for s in job.agent_signals("deletion")}
    roles: list[str] = []
    for s in sorted(last.values(), key=lambda s: s["time"]):
        if not roles or roles[-1] != s["role"]:
            roles.append(s["role"])
    return roles


def assert_clean_end(job) -> None:
    """Ordered teardown as the node agent saw it, children gone, no process left."""
    order = teardown_order(job)
    assert order == [r for r in FULL_ORDER if r in order], job.agent_signals()
    job.wait(lambda _: not job.children_left(), 60, "children removed")
    assert job.leftover_processes() == []


def assert_nothing_duplicated(job, st: dict) -> None:
    assert stage_names(st) == FULL_ORDER  # every stage once, in order
    assert {n: len(u) for n, u in job.uids_per_pod().items() if len(u) != 1} == {}  # no pod created twice
    assert job.order("deletion") == FULL_ORDER, job.agent_signals()
    assert all(c["restarts"] == 0 for c in st["components"].values()), st["components"]


def test_operator_killed_mid_run_and_during_teardown_resumes_without_duplicates(job, operator):
    # Long enough that the job cannot finish between "step 6 seen" and the trainer being frozen, even on a
    # loaded machine (40 steps were once too few under the full suite).
    job.apply(chaos_example(**{"spec.algorithm.maxSteps": MID_RUN_STEPS}))
    job.follow()
    job.wait_step(3, 300)
    operator.kill()
    job.wait_step(6, 300)  # the job trains on without its operator
    # Freeze the trainer while the operator comes back (a slow node): it must find the job still mid-run.
    trainer = job.pid("trainer")
    os.kill(trainer, signal.SIGSTOP)
    restarted_at = job.follower.step
    try:
        operator.start()
        wait_for(lambda: operator.passes(job.name) >= 2, 60, "the restarted operator reconciling", interval=0.2)
        assert job.follower.finished is None
    finally:
        os.kill(trainer, signal.SIGCONT)
    # Kill it again the moment teardown has begun (its first stage is written with phase Draining).
    wait_for(lambda: job.status().get("phase") in ("Draining", *TERMINAL), 300, "teardown begins", interval=0.02)
    operator.kill()
    stage_at_kill = (job.status().get("teardown") or {}).get("stage")
    assert stage_at_kill in FULL_ORDER, f"teardown was not under way when the operator was killed: {stage_at_kill}"
    operator.start()

    tj = job.wait_phase(TERMINAL, 300)
    st = tj["status"]
    print(f"\noperator back at step {restarted_at}, killed again during teardown stage {stage_at_kill!r}")
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == MID_RUN_STEPS and st["trainer"]["step"] == MID_RUN_STEPS
    assert_nothing_duplicated(job, st)
    assert_clean_end(job)


def test_operator_down_while_training_finishes_does_not_recreate_stopped_producers(job, operator):
    """The operator is away when the trainer publishes training_finished and the producers stop on it
    (exit 0). Restarted, it must read the event before judging those pods, not replace them."""
    # Long enough that the operator is surely killed before training finishes (20 steps once finished first).
    job.apply(chaos_example(**{"spec.algorithm.maxSteps": MID_RUN_STEPS}))
    job.follow()
    job.wait_step(3, 300)
    operator.kill()

    def producers_done():
        pods = [job.pod("actor"), job.pod("preprocessor")]
        return all(p is not None and p.status.phase == "Succeeded" for p in pods)

    wait_for(lambda: job.follower.finished is not None and producers_done(), 300, "producers stopped on the event")
    operator.start()
    tj = job.wait_phase(TERMINAL, 300)
    assert_succeeded_with_every_step(job, tj, MID_RUN_STEPS)
    assert_nothing_duplicated(job, tj["status"])
    assert_clean_end(job)


def test_a_data_parallel_rank_killed_mid_run_restarts_the_ranks_together(job):
    """kill -9 of trainer rank 1 of 2: the restarted rank finds rank 0 still in the old group, both fail and
    restart in place together, rank 0 resumes from its checkpoint and hands its state to rank 1, and the job
    succeeds with every step."""
    job.apply(chaos_example(**{"spec.trainer.nodes": 2, "spec.runPolicy.backoffLimit": 4}))
    job.follow()
    wait_for(lambda: job.follower.checkpoints, 300, "a first checkpoint", interval=0.02)
    actor = job.pid("actor")
    os.kill(actor, signal.SIGSTOP)  # surely mid-run when the rank dies (see the single-trainer test)
    try:
        os.kill(job.pid("trainer", 1), signal.SIGKILL)
    finally:
        os.kill(actor, signal.SIGCONT)
    tj = job.wait_phase(TERMINAL, 300)
    assert_succeeded_with_every_step(job, tj)
    st = tj["status"]
    print(f"\nrank 1 killed: trainer restarts {st['components']['trainer']['restarts']}")
    assert 1 <= st["components"]["trainer"]["restarts"] <= 4, st["components"]
    log0 = job.agent.container_log(job.namespace, f"{job.name}-trainer-0")
    assert "resumed from" in log0, log0[-3000:]
    assert stage_names(st) == FULL_ORDER
    assert_clean_end(job)


@pytest.mark.parametrize("claim", [None, "checkpoints"], ids=["emptyDir", "claim"])
def test_a_recreated_trainer_pod_resumes_from_its_claim_or_fails_naming_it(job, core_api, node_agent, namespace,
                                                                            claim):
    """restartPolicy.trainer Never: kill -9 of the trainer after a checkpoint the status names, and the operator
    replaces its pod. On a claim the new pod resumes from it and the job succeeds with every step; on the default
    emptyDir the new pod finds no checkpoint where its resume annotation names one, and the job fails at once
    (CheckpointLost, naming spec.trainer.checkpoint.claimName) instead of training again from step 0."""
    overrides = {"spec.runPolicy.restartPolicy": {"trainer": "Never"}}
    if claim:
        claim_dir(core_api, node_agent, namespace, claim)
        overrides["spec.trainer.checkpoint.claimName"] = claim
    job.apply(chaos_example(**overrides))
    job.follow()
    wait_for(lambda: job.follower.checkpoints, 300, "a first checkpoint", interval=0.02)
    actor = job.pid("actor")
    os.kill(actor, signal.SIGSTOP)  # surely mid-run when the trainer dies (see the in-place test above)
    try:
        # The operator writes the replacement pod's resume annotation from the status: the kill comes after it.
        saved = job.wait(lambda tj: ((tj or {}).get("status", {}).get("trainer") or {}).get("lastCheckpoint"), 60,
                         "status.trainer.lastCheckpoint")
        os.kill(job.pid("trainer"), signal.SIGKILL)
    finally:
        os.kill(actor, signal.SIGCONT)

    tj = job.wait_phase(TERMINAL, 300)
    st = tj["status"]
    trainer = f"{job.name}-trainer-0"
    assert len(job.uids_per_pod()[trainer]) == 2, job.uids_per_pod()  # recreated, not restarted in place
    warned = [e for e in job.core.list_namespaced_event(job.namespace).items if e.reason == "EphemeralCheckpoints"]
    log = job.agent.container_log(job.namespace, trainer)  # the recreated pod's
    print(f"\ntrainer pod recreated after checkpoint step {saved['step']} ({claim or 'emptyDir'}): {st['phase']} "
          f"({st.get('reason')}: {st.get('message')})")
    if claim is None:
        assert st["phase"] == "Failed" and st["reason"] == "CheckpointLost", job.diagnostics()
        m = re.search(r"spec\.trainer\.checkpoint\.claimName: checkpoint lost: the checkpoint at (\S+) step (\d+) "
                      r"is gone", st["message"])
        assert m and int(m.group(2)) >= saved["step"], st["message"]
        assert "resumed from" not in log, log[-3000:]
        steps = [m["step"] for m in job.follower.metrics]
        assert steps.count(1) == 1, steps  # the recreated trainer never trained a step again from the start
        assert [e.type for e in warned] == ["Warning"], warned  # once, at creation
    else:
        assert_succeeded_with_every_step(job, tj)
        m = re.search(r"resumed from \S+ \(step (\d+)", log)
        assert m and saved["step"] <= int(m.group(1)) < MAX_STEPS, log[-3000:]
        assert st["components"]["trainer"]["restarts"] == 1, st["components"]
        assert warned == []
    assert stage_names(st) == FULL_ORDER
    assert_clean_end(job)
