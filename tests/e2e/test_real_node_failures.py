"""Failures on the real node (kubelet + containerd, the operator installed by its chart), where the real kubelet's
behaviour is what is under test: its termination messages and crash-loop back-off, its grace period and SIGKILL,
its restart in place. Processes are killed and frozen through containerd (`ctr task kill`), as an OOM killer or a
stuck process would. Moved here from the node agent (tests/nodeagent's docstring lists what stays there).

Each test ends with a status that tells the truth and every child of the job gone. The cluster and the operator
are the session's (tests/e2e/realnode.py).
"""

from __future__ import annotations

import time

import pytest
from clusterjob import FULL_ORDER, example, stage_names
from realnode import CORE_IMAGE, REDIS_IMAGE, ContainerExits, PodWatch, RealJob
from waiting import wait_for

MAX_STEPS = 25  # the job still runs when a test acts at step 3: 40 steps take ~50 s on this node (2 shared CPUs)
TERMINAL = ("Succeeded", "Failed")
GRACE = {"actor": 3, "preprocessor": 3, "inference": 3, "trainer": 10, "redis": 3}


def chaos_example(**overrides) -> dict:
    return example(**{
        "spec.image": CORE_IMAGE, "spec.redis.image": REDIS_IMAGE,
        "spec.algorithm.maxSteps": MAX_STEPS,
        "spec.trainer.checkpoint.intervalSteps": 5,
        "spec.runPolicy.completionTimeoutSeconds": 30,
        "spec.runPolicy.eventTimeoutSeconds": 60,
        "spec.teardown.gracePeriodSeconds": GRACE,
        **overrides,
    })


@pytest.fixture
def job(real_job):
    """The real node's job handle (tests/e2e/conftest.py), under the name the node agent's tests give theirs."""
    return real_job


def assert_clean_end(job: RealJob, st: dict) -> None:
    assert stage_names(st) == FULL_ORDER, st.get("teardown")
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")


def assert_succeeded_with_every_step(job: RealJob, tj: dict, steps: int = MAX_STEPS) -> None:
    st = tj["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["completion"]["trainerExitCode"] == 0, st["completion"]


def test_crash_looping_inference_fails_the_job_within_its_budget(job):
    """`engine: vllm` in the core image (no vLLM): the inference container exits 1 at start, every time; the
    kubelet restarts it in place with its back-off, and past componentBackoffLimit the operator fails the job
    naming the pod, its exit code and the role's own words, read from the termination message the kubelet took
    from the log (FallbackToLogsOnError)."""
    budget = 1
    t0 = time.monotonic()
    job.apply(chaos_example(**{"spec.inference.engine": "vllm", "spec.runPolicy.componentBackoffLimit": budget}))
    tj = job.wait_phase(TERMINAL, 300)
    st = tj["status"]
    print(f"\ncrash-looping inference: {st['phase']} after {time.monotonic() - t0:.1f}s ({st.get('reason')})")
    assert st["phase"] == "Failed" and st["reason"] == "ComponentBackoffLimitExceeded", job.diagnostics()
    message = next(c for c in st["conditions"] if c["type"] == "Failed")["message"]
    assert f"inference failed {budget + 1} time(s); componentBackoffLimit is {budget}" in message, message
    assert f"{job.pod('inference')} (exit code 1)" in message, message
    assert "vllm is not installed" in message, message
    assert st["components"]["inference"]["restarts"] == budget + 1
    assert_clean_end(job, st)


def test_pod_ignoring_sigterm_is_killed_after_its_grace_period(job, real_node, real_api):
    """Two actors; one is frozen through containerd (SIGSTOP: SIGTERM stays pending) while the other keeps the
    job going. At teardown the kubelet gives it its grace period and then SIGKILL: containerd records its exit
    no sooner than the grace after the pod's deletion, and the kubelet reports exit code 137."""
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    exits = ContainerExits(real_node)
    exits.start()
    try:
        job.apply(chaos_example(**{"spec.actor.replicas": 2}))
        job.follow()
        job.wait_step(3)
        stuck = job.container("actor", 1)
        real_node.ctr("tasks", "kill", "--signal", "SIGSTOP", stuck)
        tj = job.wait_phase(TERMINAL, 300)
        assert_succeeded_with_every_step(job, tj)
        pod = job.pod("actor", 1)
        wait_for(lambda: stuck in exits.exits and pod in pods.deletion_seen, 60,
                 lambda: f"{pod}'s exit in containerd's events and its deletion seen")
    finally:
        pods.stop()
        exits.stop()
    waited = (exits.exits[stuck] - pods.deletion_seen[pod]).total_seconds()
    print(f"\nstuck actor: exited {waited:.1f}s after its deletion was seen (grace {GRACE['actor']}s), "
          f"kubelet: {pods.terminated.get(pod)}")
    # deletion_seen is when the watch saw it, a little after the API server stored it: a small slack.
    assert waited >= GRACE["actor"] - 0.5, waited
    assert pods.terminated.get(pod, (None,))[0] == 137, pods.terminated
    assert_clean_end(job, tj["status"])


def test_redis_killed_mid_run_ends_in_a_truthful_state(job, real_node):
    """kill -9 of redis-server through containerd at step 3: the kubelet restarts it in place, empty; the job
    must end (no hang), and Succeeded only with every step the trainer reported."""
    job.apply(chaos_example(**{"spec.runPolicy.eventTimeoutSeconds": 30}))
    job.follow()
    job.wait_step(3)
    real_node.ctr("tasks", "kill", "--signal", "SIGKILL", job.container("redis"))
    tj = job.wait_phase(TERMINAL, 300)
    st = tj["status"]
    print(f"\nafter kill -9 of Redis: {st['phase']} ({st.get('reason')}: {st.get('message')}); "
          f"redis restarts {st['components']['redis'].get('restarts')}")
    if st["phase"] == "Succeeded":
        assert_succeeded_with_every_step(job, tj)
    else:
        assert st.get("reason") and st.get("message"), st
        assert (st.get("completion") or {}).get("finalStep") != MAX_STEPS or st["reason"] != "TrainingFinished"
    assert_clean_end(job, st)


def test_actor_killed_mid_run_restarts_in_place_and_the_job_continues(job, real_node):
    """kill -9 of the actor's container through containerd at step 3: the kubelet restarts it in the same pod, the
    operator counts the restart, and the job Succeeds with every step."""
    job.apply(chaos_example())
    job.follow()
    job.wait_step(3)
    uid = job.core.read_namespaced_pod(job.pod("actor"), job.namespace).metadata.uid
    real_node.ctr("tasks", "kill", "--signal", "SIGKILL", job.container("actor"))

    def restarted():
        p = job.core.read_namespaced_pod(job.pod("actor"), job.namespace)
        (cs,) = p.status.container_statuses
        return p if cs.restart_count >= 1 and cs.state.running else None

    pod = wait_for(restarted, 120, lambda: f"the actor restarted\n{job.diagnostics()}", 0.2)
    assert pod.metadata.uid == uid, "the actor's pod was recreated, not restarted in place"
    assert pod.status.container_statuses[0].last_state.terminated.exit_code == 137
    tj = job.wait_phase(TERMINAL, 300)
    assert_succeeded_with_every_step(job, tj)
    st = tj["status"]
    assert st["components"]["actor"]["restarts"] == 1, st["components"]
    steps = [m["step"] for m in job.follower.metrics]
    assert set(steps) == set(range(1, MAX_STEPS + 1)), steps
    assert_clean_end(job, st)


def test_trainingjob_deleted_mid_run_stops_every_container_in_order(job, real_node, real_api):
    """The TrainingJob deleted at step 3: the operator deletes its pods in the order of docs/design.md §4.4 and
    the kubelet stops every container (SIGTERM, then SIGKILL past its grace), as containerd recorded the exits;
    the finalizer is released once all are gone."""
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    exits = ContainerExits(real_node)
    exits.start()
    try:
        job.apply(chaos_example(**{"spec.algorithm.maxSteps": 100}))
        job.follow()
        job.wait_step(3)
        job.custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", job.namespace, "trainingjobs", job.name)
        wait_for(lambda: job.get() is None, 120, lambda: f"the TrainingJob removed\n{job.diagnostics()}", 0.5)
        wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    finally:
        pods.stop()
        exits.stop()
    roles = {job.pod(r): r for r in FULL_ORDER if r != "redis"} | {f"{job.name}-redis": "redis"}
    deleted = [roles[p] for p in sorted(pods.deleted_at_rv, key=pods.deleted_at_rv.get)]
    assert deleted == FULL_ORDER, pods.deleted_at_rv
    exited = {}
    for pod, ids in pods.containers.items():
        times = [exits.exits[i] for i in ids if i in exits.exits]
        assert times, f"no exit of {pod}'s containers {ids} in containerd's events"
        exited[roles[pod]] = max(times)
    print("\ndeleted mid-run at step {}: exits {}".format(job.follower.step, ", ".join(
        f"{r} +{(t - pods.deletion_seen[p]).total_seconds():.1f}s {pods.terminated.get(p)}"
        for p, r in roles.items() if (t := exited.get(r)))))
    assert sorted(exited, key=exited.get) == FULL_ORDER, exited
    for pod, role in roles.items():
        # Every container ran until its pod's deletion (none ended on its own first), and none was SIGKILLed
        # before its grace ran out (exit 137 only after the grace).
        waited = (exited[role] - pods.deletion_seen[pod]).total_seconds()
        assert waited > -0.5, (role, waited)
        if pods.terminated.get(pod, (None,))[0] == 137:
            assert waited >= GRACE[role] - 0.5, (role, waited, pods.terminated[pod])
    job.name = ""  # gone already: nothing for the fixture to delete
