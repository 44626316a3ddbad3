"""examples/tiny-cpu.yaml on a real node, with the operator installed by its chart: no node agent anywhere.

A control plane, kube-scheduler, a kubelet on containerd + runc + the CNI bridge, kube-proxy and the cluster DNS
(tests/cluster/node.py, tests/cluster/dns.py); the images `make images` builds (images/build.py: operator, core,
redis; content-cached) imported into containerd. The cluster and the chart's install are the session's, shared with
the other real-node modules (tests/support/realnode.py, fixtures in tests/e2e/real_node/conftest.py). What this shows,
as users
would meet it:
- charts/rlkube installed with the Helm SDK as `helm install` does (CRDs, then the templates): the operator's
  Deployment runs from localhost/rlkube/operator with its ServiceAccount and RBAC, reaches the API server through
  the `kubernetes` Service (kube-proxy), and holds the leader-election Lease;
- the TrainingJob, applied through the API server (and the chart's validating webhook), with its images pointed
  at the local builds, Succeeds at its last step and learns (reward margin: clusterjob.MIN_MARGIN);
- every role's container runs as uid 10001 on a read-only root, shown from inside it (exec through the API
  server and the kubelet);
- the pods are deleted in the teardown order of docs/design.md §4.4, and the containers that were still running
  stopped in that order, as containerd recorded their exits.
"""

from __future__ import annotations

import re
import time

import pytest
from support.clusterjob import MIN_MARGIN, EventFollower, example, secret_password
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.realnode import (LOCAL_IMAGES, OPERATOR_IMAGE, OPERATOR_NS, ContainerExits, PodWatch, container_id,
                      create_namespace, diagnostics, hostpath_claim, inside, lease_holder,
                      operator_pod, webhook_serving)
from rlkube.contract import protocol, runtime
from rlkube.controller.manifests import builders, names
from support import specs
from support.waiting import wait_for

JOB_NS, CHAOS_NS = "team-a", "team-b"
ROLES = ("trainer", "inference", "actor", "preprocessor", "redis")


@pytest.fixture(scope="module")
def node(real_node):
    return real_node


@pytest.fixture(scope="module")
def api(real_api):
    return real_api


@pytest.fixture(scope="module")
def operator(chart_operator):
    return chart_operator


def test_chart_installed_operator_runs_tiny_cpu_on_the_real_node(node, api, operator):
    core = client.CoreV1Api(api)
    (container,) = operator.spec.containers
    assert container.image == OPERATOR_IMAGE and operator.spec.node_name == node.name
    assert container.image_pull_policy == "Never"

    create_namespace(core, JOB_NS)
    custom = client.CustomObjectsApi(api)
    # The chart's validating webhook, served by the operator pod, reached by the API server through its Service
    # (kube-proxy): `kubectl apply --dry-run=server` of a bad job is refused naming the field. First a valid job's
    # dry run passes: the Service's endpoints reach kube-proxy's rules a moment after the pod is Ready.
    webhook_serving(api, JOB_NS, example(), node)
    for bad, says in ((example(**{"spec.trainer.nodes": 4, "spec.algorithm.samplesPerStep": 2}),
                       "spec.algorithm.samplesPerStep: must be at least the trainer's ranks"),
                      (example(**{"spec.actor.image": "my image:latest"}),
                       "spec.actor.image: 'my image:latest' is not an image reference")):
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", JOB_NS, "trainingjobs", bad, dry_run="All")
        assert refused.value.status == 422 and says in refused.value.body, refused.value.body
        assert 'admission webhook \\"validate.trainingjobs.rlkube.io\\" denied' in refused.value.body
    pods = PodWatch(api, JOB_NS)
    pods.start()
    exits = ContainerExits(node)
    exits.start()
    doc = example(**LOCAL_IMAGES)
    t1 = time.monotonic()
    custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", JOB_NS, "trainingjobs", doc)
    name = doc["metadata"]["name"]

    def job() -> dict:
        return custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", JOB_NS, "trainingjobs", name)

    def running(pod_name: str):
        try:
            p = core.read_namespaced_pod(pod_name, JOB_NS)
        except ApiException:
            return None
        return p if p.status.phase == "Running" else None

    redis_pod = f"{name}-redis"
    wait_for(lambda: running(redis_pod), 120, lambda: f"{redis_pod} running\n{diagnostics(core, node)}", 0.5)

    def locate():
        p = running(redis_pod)
        if p is None:
            raise ConnectionError(f"{redis_pod} is not running")
        secret = core.read_namespaced_secret(names.secret_name(name), JOB_NS)
        return f"redis://{p.status.pod_ip}:{runtime.REDIS_PORT}/0", secret_password(secret)

    follower = EventFollower(locate, protocol.StreamKeys.for_job(JOB_NS, name, "torch").events)
    follower.start()

    # Each role's container, from inside, while the job runs.
    seen = {}
    for role in ROLES:
        pod = redis_pod if role == "redis" else names.pod_name(name, role, 0)
        wait_for(lambda: running(pod), 180, lambda: f"{pod} running\n{diagnostics(core, node)}", 0.5)
        seen[role] = inside(core, JOB_NS, pod, role)
    print("inside the containers: " + "; ".join(f"{r}: {v}" for r, v in seen.items()))
    for role, said in seen.items():
        uid = str(builders.RUN_AS)
        assert said == {"uid": uid, "gid": uid, "pid1-uid": uid, "root": "ro", "write": "refused"}, (role, said)

    st = wait_for(lambda: (s := job().get("status") or {}).get("phase") in ("Succeeded", "Failed") and s, 300,
                  lambda: f"the job to end: {job().get('status')}\n{diagnostics(core, node)}", 0.5)
    wall = time.monotonic() - t1
    assert st["phase"] == "Succeeded", f"{st}\n{diagnostics(core, node)}"
    assert st["completion"]["finalStep"] == 40 and st["completion"]["trainerExitCode"] == 0
    follower.stop()
    margin, rewards = follower.reward_margin(), follower.rewards()
    assert margin is not None, follower.describe()
    print(f"tiny-cpu on the real node: {wall:.1f}s to Succeeded, reward first-10 {sum(rewards[:10]) / 10:.3f} "
          f"last-10 {sum(rewards[-10:]) / 10:.3f} (margin {margin:.3f}), {len(rewards)} steps")
    assert margin >= MIN_MARGIN, rewards

    # Teardown: the API server's order of the pod deletions, and containerd's exit times of the containers.
    wait_for(lambda: not core.list_namespaced_pod(JOB_NS).items, 120, "the job's pods to be gone")
    pods.stop()
    exits.stop()
    def pod_of(role: str) -> str:
        return redis_pod if role == "redis" else names.pod_name(name, role, 0)

    role_of = {pod_of(r): r for r in ROLES}
    deleted = [role_of[p] for p in sorted(pods.deleted_at_rv, key=pods.deleted_at_rv.get)]
    assert deleted == list(specs.POD_ORDER), pods.deleted_at_rv
    exited = {}
    for pod, ids in pods.containers.items():
        times = [exits.exits[i] for i in ids if i in exits.exits]
        assert times, f"no exit of {pod}'s containers {ids} in containerd's events"
        exited[role_of[pod]] = max(times)
    print("containers exited (containerd; kubelet's exit code, reason): " + ", ".join(
        f"{r} {t.strftime('%H:%M:%S.%f')[:-3]} {pods.terminated.get(pod_of(r))}"
        for r, t in sorted(exited.items(), key=lambda kv: kv[1])))
    # The trainer ends on its own (that is what Succeeds the job), and the actor and preprocessor may end on the
    # same training_finished before their pods are deleted. The servers are stopped by the teardown, in its order,
    # Redis last: each exits after its pod's deletion was requested (the API server's time, in whole seconds:
    # the watch's own time of seeing the deletion lagged by seconds under load, so every role looked as if it had
    # ended before it), and inference after the actor, the preprocessor and the trainer (all done by then). The
    # trainer's end on its own follows: it exited before inference, whose pod the API server deleted before the
    # trainer's (the deletion order above).
    for server in ("inference", "redis"):
        assert exited[server] >= pods.deletion_requested[pod_of(server)], (server, exited, pods.deletion_requested)
    assert exited["inference"] > max(exited[r] for r in ("actor", "preprocessor", "trainer")), exited
    assert max(exited, key=exited.get) == "redis"
    errors = [line for line in core.read_namespaced_pod_log(operator.metadata.name, OPERATOR_NS).splitlines()
              if "Traceback" in line or "ERROR" in line]
    print(f"operator log: {len(errors)} error lines" + "".join(f"\n  {e[:300]}" for e in errors[:10]))


CHAOS_STEPS = 60


def test_trainer_and_operator_killed_with_sigkill_through_containerd(node, api, operator):
    """kill -9 of the trainer's container after its first checkpoint (on a claim): the kubelet restarts it in
    place and it resumes from the checkpoint; then kill -9 of the operator's container, its pod removed: the
    Deployment's new pod takes the Lease once it expires and finishes the job, every step once."""
    core = client.CoreV1Api(api)
    create_namespace(core, CHAOS_NS)
    claim = hostpath_claim(core, node, CHAOS_NS, "checkpoints")
    doc = example(**{
        **LOCAL_IMAGES, "spec.algorithm.maxSteps": CHAOS_STEPS,
        "spec.trainer.checkpoint.intervalSteps": 5, "spec.trainer.checkpoint.claimName": "checkpoints",
        "spec.teardown.gracePeriodSeconds": {"actor": 3, "preprocessor": 3, "inference": 3, "trainer": 10, "redis": 3},
    })
    name = doc["metadata"]["name"]
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("rlkube.io", "v1alpha1", CHAOS_NS, "trainingjobs", doc)
    redis_pod, trainer_pod = f"{name}-redis", names.pod_name(name, "trainer", 0)
    wait_for(lambda: container_id(core, CHAOS_NS, redis_pod), 180,
             lambda: f"{redis_pod} running\n{diagnostics(core, node)}", 0.5)

    def locate():
        p = core.read_namespaced_pod(redis_pod, CHAOS_NS)
        secret = core.read_namespaced_secret(names.secret_name(name), CHAOS_NS)
        return f"redis://{p.status.pod_ip}:{runtime.REDIS_PORT}/0", secret_password(secret)

    follower = EventFollower(locate, protocol.StreamKeys.for_job(CHAOS_NS, name, "torch").events)
    follower.start()
    wait_for(lambda: follower.checkpoints, 300, lambda: f"a first checkpoint\n{diagnostics(core, node)}", 0.1)
    # The actor frozen, so the trainer is surely mid-run when killed (as tests/e2e/node_agent/test_chaos.py does).
    actor_pod = names.pod_name(name, "actor", 0)
    actor = wait_for(lambda: container_id(core, CHAOS_NS, actor_pod), 60,
                     lambda: f"{actor_pod} running\n{diagnostics(core, node)}", 0.1)
    trainer = wait_for(lambda: container_id(core, CHAOS_NS, trainer_pod), 60,
                       lambda: f"{trainer_pod} running\n{diagnostics(core, node)}", 0.1)
    node.ctr("tasks", "kill", "--signal", "SIGSTOP", actor)
    try:
        saved_before_kill = max(follower.checkpoints)
        node.ctr("tasks", "kill", "--signal", "SIGKILL", trainer)
    finally:
        node.ctr("tasks", "kill", "--signal", "SIGCONT", actor)

    def restarted():
        p = core.read_namespaced_pod(trainer_pod, CHAOS_NS)
        (cs,) = p.status.container_statuses
        return p if cs.restart_count == 1 and cs.state.running else None

    pod = wait_for(restarted, 120, lambda: f"the trainer restarted in place\n{diagnostics(core, node)}", 0.5)
    last = pod.status.container_statuses[0].last_state.terminated
    assert last.exit_code == 137, last
    # The restarted container's log, through the API server from the kubelet.
    log = wait_for(lambda: (t := core.read_namespaced_pod_log(trainer_pod, CHAOS_NS)) and "resumed from" in t and t,
                   120, "the trainer to resume", 0.5)
    resumed = int(re.search(r"resumed from \S+ \(step (\d+)", log).group(1))
    step_at_operator_kill = follower.step

    # kill -9 of the operator: its container, then its pod (else the kubelet would restart it in place).
    old = operator_pod(core)
    node.ctr("tasks", "kill", "--signal", "SIGKILL", container_id(core, OPERATOR_NS, old.metadata.name))
    core.delete_namespaced_pod(old.metadata.name, OPERATOR_NS, grace_period_seconds=0)
    new = wait_for(lambda: (p := operator_pod(core)) and p.metadata.name != old.metadata.name and p, 120,
                   lambda: f"the Deployment's new operator pod\n{diagnostics(core, node)}", 0.5)
    holder = wait_for(lambda: (h := lease_holder(api)) and h.startswith(f"{new.metadata.name}_") and h, 60,
                      "the new operator pod to take the Lease", 0.5)

    st = wait_for(lambda: (s := custom.get_namespaced_custom_object("rlkube.io", "v1alpha1", CHAOS_NS, "trainingjobs",
                                                                    name).get("status") or {}).get("phase")
                  in ("Succeeded", "Failed") and s, 300, lambda: f"the job to end\n{diagnostics(core, node)}", 0.5)
    follower.stop()
    assert st["phase"] == "Succeeded", f"{st}\n{diagnostics(core, node)}"
    assert st["completion"]["finalStep"] == CHAOS_STEPS and st["components"]["trainer"]["restarts"] == 1, st
    steps = [m["step"] for m in follower.metrics]
    assert steps[-1] == CHAOS_STEPS and set(steps) == set(range(1, CHAOS_STEPS + 1)), steps
    print(f"\ntrainer killed after checkpoint {saved_before_kill}, resumed from step {resumed}; operator "
          f"{old.metadata.name} killed at step {step_at_operator_kill}, {holder.split('_')[0]} took the Lease; "
          f"checkpoints on the claim: {sorted(p.name for p in claim.iterdir())}")
    # From the newest checkpoint on the claim: at least the one announced when it was killed, and mid-run.
    assert saved_before_kill <= resumed < CHAOS_STEPS and resumed % 5 == 0, (saved_before_kill, resumed)
