"""Failures on the real node (kubelet + containerd, the operator installed by its chart), where the real kubelet's
behaviour is what is under test: its termination messages and crash-loop back-off, its grace period and SIGKILL,
its restart in place. Each job costs about a minute here (pods in containers on 2 shared CPUs), so what one job
can show together is shown by one. Processes are killed and frozen through containerd (`ctr task kill`), as an OOM
killer or a stuck process would. Moved here from the node agent (tests/nodeagent's docstring lists what stays there).

Each test ends with a status that tells the truth and every child of the job gone. The cluster and the operator
are the session's (tests/support/realnode.py).
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from support import clusterjob
from support.clusterjob import FULL_ORDER, POD_ORDER, stage_names
from support.realnode import CORE_IMAGE, LOCAL_IMAGES, ContainerExits, PodWatch, RealJob
from support.waiting import wait_for

MAX_STEPS = 25  # the job still runs when a test acts at step 3: 40 steps take ~50 s on this node (2 shared CPUs)
TERMINAL = ("Succeeded", "Failed")
GRACE = clusterjob.CHAOS_GRACE


def chaos_example(**overrides) -> dict:
    return clusterjob.chaos_example(MAX_STEPS, **{**LOCAL_IMAGES, **overrides})


@pytest.fixture
def job(real_job):
    """The real node's job handle (tests/e2e/real_node/conftest.py), under the name the node agent's tests give
    theirs."""
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


def test_an_image_the_kubelet_cannot_pull_fails_the_job_naming_the_field(job):
    """A typo in `spec.trainer.image`: the kubelet's pull of it fails (no registry answers for it here) and it
    backs off, forever; nothing exits, so no restart budget would end it. Past imagePullTimeoutSeconds the operator
    fails the job ImagePullFailed, naming the field, the image, the pod and the kubelet's reason. Nothing
    restarted; every child is gone."""
    typo = CORE_IMAGE.rsplit(":", 1)[0] + ":no-such-tag"
    t0 = time.monotonic()
    job.apply(chaos_example(**{"spec.trainer.image": typo, "spec.runPolicy.imagePullTimeoutSeconds": 10}))
    tj = job.wait_phase(TERMINAL, 180)
    st = tj["status"]
    print(f"\nunpullable trainer image: {st['phase']} after {time.monotonic() - t0:.1f}s ({st.get('reason')}: "
          f"{st.get('message')})")
    assert st["phase"] == "Failed" and st["reason"] == "ImagePullFailed", job.diagnostics()
    message = st["message"]
    assert "spec.trainer.image" in message and repr(typo) in message and job.pod("trainer") in message, message
    assert "ErrImagePull" in message or "ImagePullBackOff" in message, message
    assert all(c.get("restarts", 0) == 0 for c in st["components"].values()), st["components"]
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")


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
    # 60 steps: the job must still run while the kubelet restarts the actor (25 ended first once).
    job.apply(chaos_example(**{"spec.algorithm.maxSteps": 60}))
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
    assert_succeeded_with_every_step(job, tj, 60)
    st = tj["status"]
    assert st["components"]["actor"]["restarts"] == 1, st["components"]
    steps = [m["step"] for m in job.follower.metrics]
    assert set(steps) == set(range(1, 61)), steps
    assert_clean_end(job, st)


def test_job_deleted_mid_run_stops_every_container_in_order_and_a_pod_ignoring_sigterm_after_its_grace(
        job, real_node, real_api):
    """Two actors, one frozen through containerd (SIGSTOP: SIGTERM stays pending, as in a process that ignores
    it); the TrainingJob deleted at step 3. The operator deletes the pods in the order of docs/design.md §4.4; the
    kubelet stops every container, as containerd recorded the exits: each after its pod's deletion, in that
    order, and the frozen actor only by SIGKILL once its grace period ran out (exit code 137, no sooner than the
    grace); the finalizer is released once all are gone. One job for both (each job costs a minute here)."""
    pods = PodWatch(real_api, job.namespace)
    pods.start()
    exits = ContainerExits(real_node)
    exits.start()
    try:
        job.apply(chaos_example(**{"spec.algorithm.maxSteps": 100, "spec.actor.replicas": 2}))
        job.follow()
        job.wait_step(3)
        stuck = job.container("actor", 1)
        real_node.ctr("tasks", "kill", "--signal", "SIGSTOP", stuck)
        job.custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", job.namespace, "trainingjobs", job.name)
        wait_for(lambda: job.get() is None, 120, lambda: f"the TrainingJob removed\n{job.diagnostics()}", 0.5)
        wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
        wait_for(lambda: stuck in exits.exits, 30, "the frozen actor's exit in containerd's events")
    finally:
        pods.stop()
        exits.stop()
    role_of = {job.pod(r, i): r for r in FULL_ORDER if r != "redis" for i in range(2 if r == "actor" else 1)}
    role_of[f"{job.name}-redis"] = "redis"
    deleted = [role_of[p] for p in sorted(pods.deleted_at_rv, key=pods.deleted_at_rv.get)]
    assert deleted == sorted(role_of.values(), key=FULL_ORDER.index), pods.deleted_at_rv
    # When each pod's deletion was stored lies between two readings: the API server's deletionTimestamp less the
    # grace (whole seconds, truncated: at most 1 s early) and when the watch saw it (late by the watch's lag, which
    # under load is seconds). `waited` is the least time each exit can have followed its deletion, `since_request`
    # the most.
    exited, waited, since_request = {}, {}, {}
    for pod, ids in pods.containers.items():
        times = [exits.exits[i] for i in ids if i in exits.exits]
        assert times, f"no exit of {pod}'s containers {ids} in containerd's events"
        exited[pod] = max(times)
        requested = pods.deletion_requested[pod]
        waited[pod] = (exited[pod] - min(requested + timedelta(seconds=1), pods.deletion_seen[pod])).total_seconds()
        since_request[pod] = (exited[pod] - requested).total_seconds()
    print("\ndeleted mid-run at step {}: exits after deletion {}".format(job.follower.step, ", ".join(
        f"{p.removeprefix(job.name + '-')} +{waited[p]:.1f}s" for p in role_of if p in waited)))
    by_role = {}
    for pod, t in exited.items():
        by_role[role_of[pod]] = max(t, by_role.get(role_of[pod], t))
    assert sorted(by_role, key=by_role.get) == POD_ORDER, exited
    frozen = job.pod("actor", 1)
    # The kubelet counts the grace from when it learns of the deletion, after it was stored: the least wait is the
    # grace, less the up to 1 s that `waited` can fall short.
    status = {pod: max(exits.status[i] for i in ids if i in exits.status) for pod, ids in pods.containers.items()}
    assert waited[frozen] >= GRACE["actor"] - 1 and status[frozen] == 137, (waited, status)
    # A pod still Pending when deleted (no container started: on 2 shared CPUs a second actor can wait for the
    # scheduler or the image) has no exit to time.
    for pod in waited:
        assert since_request[pod] >= 0, (pod, since_request)  # none ended on its own before its deletion
        if pod != frozen and status[pod] == 137:
            assert waited[pod] >= GRACE[role_of[pod]] - 1, (pod, waited, status)
    job.name = ""  # gone already: nothing for the fixture to delete
