"""Chaos on a running TrainingJob that stays on the test node agent (tests/nodeagent; its docstring says why): the
operator killed with -9 mid-run and again during teardown, and the operator away while training finishes. Both need
an operator process the test stops and starts at instants shorter than a pod's start.
Each test ends with a status that tells the truth and no process left.

The kills the real kubelet shows for real run on the real node: tests/e2e/real_node/test_real_cluster.py (the trainer
killed, restarted in place, resuming from its claim; the operator's pod killed),
tests/e2e/real_node/test_real_node_failures.py (the actor and Redis killed, a pod ignoring SIGTERM, the job deleted
mid-run) and tests/e2e/real_node/test_real_node_restarts.py (a trainer pod recreated with or without its checkpoint
claim, a data-parallel rank killed).

A shorter copy of examples/tiny-cpu.yaml keeps them quick: a checkpoint every 5 steps, short grace periods.
"""

from __future__ import annotations

import os
import signal

from support import clusterjob
from support.clusterjob import FULL_ORDER, POD_ORDER, stage_names
from nodeagent.harness import wait_for

# Long enough that the job cannot finish between "step 6 seen" and the trainer being frozen, nor before the
# operator is killed, even on a loaded machine (40 and 20 steps were once too few under the full suite).
MAX_STEPS = 100
TERMINAL = ("Succeeded", "Failed")


def chaos_example(**overrides) -> dict:
    return clusterjob.chaos_example(MAX_STEPS, **overrides)


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
    assert order == [r for r in POD_ORDER if r in order], job.agent_signals()
    job.wait(lambda _: not job.children_left(), 60, "children removed")
    assert job.leftover_processes() == []


def assert_nothing_duplicated(job, st: dict) -> None:
    assert stage_names(st) == FULL_ORDER  # every stage once, in order
    assert {n: len(u) for n, u in job.uids_per_pod().items() if len(u) != 1} == {}  # no pod created twice
    assert job.order("deletion") == POD_ORDER, job.agent_signals()
    assert all(c["restarts"] == 0 for c in st["components"].values()), st["components"]


def test_operator_killed_mid_run_and_during_teardown_resumes_without_duplicates(job, operator):
    job.apply(chaos_example())
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
    assert st["completion"]["finalStep"] == MAX_STEPS and st["trainer"]["step"] == MAX_STEPS
    assert_nothing_duplicated(job, st)
    assert_clean_end(job)


def test_operator_down_while_training_finishes_does_not_recreate_stopped_producers(job, operator):
    """The operator is away when the trainer publishes training_finished and the producers stop on it
    (exit 0). Restarted, it must read the event before judging those pods, not replace them."""
    job.apply(chaos_example())
    job.follow()
    job.wait_step(3, 300)
    operator.kill()

    def producers_done():
        pods = [job.pod("actor"), job.pod("preprocessor")]
        return all(p is not None and p.status.phase == "Succeeded" for p in pods)

    wait_for(lambda: job.follower.finished is not None and producers_done(), 300, "producers stopped on the event")
    operator.start()
    tj = job.wait_phase(TERMINAL, 300)
    assert_succeeded_with_every_step(job, tj)
    assert_nothing_duplicated(job, tj["status"])
    assert_clean_end(job)
