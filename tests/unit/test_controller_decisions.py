"""The operator's decisions, one transition per row: (status, pods, events, time) -> actions, phase, conditions.

Pure: no cluster, no Redis. Each row names the transition of docs/design.md §4 it covers; the integration tests
(tests/integration/test_operator_*.py) show the same rows against the real API server and Redis.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from rlkube.api.status import (
    CheckpointRef,
    TrainingJobStatus,
)
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.controller.decisions.actions import (
    Create,
    DeleteJob,
    DeleteObject,
    DeletePod,
    DeleteStreams,
)
from rlkube.controller.decisions.recipe import Decision, JobView, decide
from rlkube.controller.decisions.observed import EventSource, Observed, PodView, Rejected
from rlkube.controller.decisions.times import fmt_time
from rlkube.contract import protocol
from rlkube.contract.protocol import TrainerEvent
from support import specs

T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
ALL_STATIC = frozenset(
    {"ConfigMap/j-config", "Secret/j-redis", "NetworkPolicy/j-redis", "Service/j-redis", "Service/j-inference",
     "Service/j-trainer"}
)
REACHABLE = EventSource("Reachable", "Connected", "redis://10.0.0.9:6379/0", caught_up=True)


def raw_spec(**overrides) -> dict:
    return specs.spec(**{"runPolicy.completionTimeoutSeconds": 60, "runPolicy.eventTimeoutSeconds": 300, **overrides})


def job(status: TrainingJobStatus | None = None, deleting: bool = False, generation: int = 1, changed: bool = False,
        **overrides) -> JobView:
    """The job with this spec. Rows about other rules pass a status built from the default spec: it is taken to
    have started with this spec; `changed=True` keeps the recorded startedSpec (a spec changed mid-run)."""
    raw = raw_spec(**overrides)
    if status is not None and status.started_spec is not None and not changed:
        status = status.model_copy(update={"started_spec": raw})
    try:
        spec, error = parse_spec(raw), None
    except SpecError as exc:
        spec, error = None, str(exc)
    return JobView("ns", "j", "uid-j", generation, raw, spec, error, deleting, status or TrainingJobStatus())


def pod(role: str, index: int = 0, phase: str = "Running", ready: bool = True, **kw) -> PodView:
    name = "j-redis" if role == "redis" else f"j-{role}-{index}"
    kw.setdefault("uid", f"uid-{name}")
    kw.setdefault("started_at", T0 - timedelta(minutes=5))
    kw.setdefault("pod_ip", "10.0.0.9")
    return PodView(name=name, role=role, index=index, phase=phase, ready=ready and phase == "Running", **kw)


def all_pods(**per_role) -> list[PodView]:
    """One running, ready pod per role; per_role replaces a role's pod (None removes it)."""
    out = []
    for role in ("redis", "trainer", "inference", "preprocessor", "actor"):
        p = per_role.get(role, pod(role))
        if p is not None:
            out.append(p)
    return out


def ev(type_: str, ms: int, **payload) -> TrainerEvent:
    return TrainerEvent(f"{ms}-0", type_, {"type": type_, **payload})


def ms(t: datetime) -> int:
    return int(t.timestamp() * 1000)


def run(j: JobView, pods=(), events=(), now=T0, source=REACHABLE, static=ALL_STATIC, read_upto=None,
        read_to_end=True, rejected=None) -> Decision:
    obs = Observed(pods=tuple(pods), events=tuple(events), read_upto=read_upto, event_source=source,
                   events_read_to_end=read_to_end, static_present=frozenset(static), create_rejected=rejected)
    return decide(j, obs, now)


def running_status(**overrides) -> TrainingJobStatus:
    """A job that reached Running at T0 - 1 min (one pass over all pods)."""
    d = run(job(), all_pods(), now=T0 - timedelta(minutes=2))
    d = run(job(d.status), all_pods(), now=T0 - timedelta(minutes=1))
    assert d.status.phase == "Running", d.status.phase
    return d.status.model_copy(update=overrides)


def cond(status: TrainingJobStatus, type_: str):
    return next((c for c in status.conditions if c.type == type_), None)


def creates(d: Decision) -> list[str]:
    return [a.name for a in d.actions if isinstance(a, Create)]


def deletes(d: Decision) -> list[tuple[str, int]]:
    return [(a.name, a.grace_seconds) for a in d.actions if isinstance(a, DeletePod)]


def outcome_of(d: Decision) -> tuple[str, str] | None:
    for kind in ("Succeeded", "Failed"):
        c = cond(d.status, kind)
        if c is not None and c.status == "True":
            return kind, c.reason
    return None


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in d.events]


# -- start-up: Pending -> Starting -> Running, readiness-gated creation ---------------------------------


def test_new_job_is_pending_and_creates_config_services_secret_and_redis_only():
    d = run(job(), static=())
    assert d.status.phase == "Pending" and d.status.start_time == fmt_time(T0)
    assert creates(d) == ["j-config", "j-redis", "j-redis", "j-redis", "j-inference", "j-trainer", "j-redis"]
    assert [a.kind for a in d.actions] == ["ConfigMap", "Secret", "NetworkPolicy", "Service", "Service", "Service",
                                           "Pod"]
    # One Event says it is accepted: the first phase (Events are API writes, so there is no separate one); the
    # example's checkpoints are on an emptyDir, which gets its warning (next test).
    assert [(e.reason, e.message) for e in d.events if e.reason != "EphemeralCheckpoints"] == [
        ("Pending", "accepted, Pending: PodsPending children created, no pod running yet")]
    assert d.watch_events and cond(d.status, "EventSourceReachable").status == "True"


def test_a_new_job_on_an_empty_dir_checkpoint_volume_with_restarts_allowed_is_warned_once():
    d = run(job(), static=())
    [warning] = [e for e in d.events if e.reason == "EphemeralCheckpoints"]
    assert warning.type == "Warning"
    assert "spec.trainer.checkpoint.claimName is unset" in warning.message and "backoffLimit 2" in warning.message
    assert "starts over without its checkpoints" in warning.message
    for later in (run(job(d.status), [pod("redis")]), run(job(running_status()), all_pods())):  # never again
        assert "EphemeralCheckpoints" not in reasons(later)
    # Checkpoints on a claim, or no trainer restart allowed: nothing to warn about.
    for overrides in ({"trainer.checkpoint.claimName": "ckpt"}, {"runPolicy.backoffLimit": 0}):
        assert "EphemeralCheckpoints" not in reasons(run(job(**overrides), static=()))


def test_a_trainer_that_lost_its_checkpoint_fails_the_job_at_once_naming_the_claim():
    """The replaced trainer pod (its resume annotation says step 10) found an empty volume and exited 78."""
    st = running_status(trainer=running_status().trainer.model_copy(
        update={"last_checkpoint": CheckpointRef(step=10, path="/checkpoints/step-000010")}))
    message = ("spec.trainer.checkpoint.claimName: checkpoint lost: the checkpoint at /checkpoints/step-000010 step "
               "10 is gone (/checkpoints holds no checkpoint): ...")
    lost = pod("trainer", phase="Failed", ready=False, exit_code=78, termination_message=message, uid="uid-2")
    d = run(job(st), all_pods(trainer=lost))
    assert outcome_of(d) == ("Failed", "CheckpointLost") and d.status.phase == "Draining"
    assert "spec.trainer.checkpoint.claimName" in cond(d.status, "Failed").message
    assert "j-trainer-0" not in creates(d)  # not replaced again: a restart cannot bring the volume back


def pulling(role: str, reason: str, **kw) -> PodView:
    """A pod whose container waits on its image (the kubelet's reason and message)."""
    return pod(role, phase="Pending", ready=False, started_at=None, pod_ip=None, waiting_reason=reason,
               waiting_message=f'failed to pull image "{role}:x": connection refused', **kw)


def test_an_image_that_cannot_be_pulled_fails_the_job_after_its_timeout_naming_the_field():
    """controller/decisions/image_pull.py: the kubelet retries a pull forever; the job fails once the pull has failed
    for the timeout since the operator first saw it fail (kept in the status), naming the field that set the image and
    quoting the kubelet."""
    actor = pulling("actor", "ErrImagePull")

    def j(st: TrainingJobStatus) -> JobView:
        return job(st, **{"actor.image": "localhost/rlkube/nope:1", "runPolicy.imagePullTimeoutSeconds": 120})

    d = run(j(running_status()), all_pods(actor=actor))
    assert outcome_of(d) is None and d.status.phase == "Running"
    assert d.status.components["actor"].pull_failing_since == {actor.uid: fmt_time(T0)}
    assert d.requeue_after == pytest.approx(120)  # looks again at the deadline, not later
    assert "waiting: ErrImagePull" in cond(d.status, "ActorsReady").message
    backoff = pulling("actor", "ImagePullBackOff")  # the kubelet alternates the two: one failure, one clock
    d = run(j(d.status), all_pods(actor=backoff), now=T0 + timedelta(seconds=119))
    assert outcome_of(d) is None and d.requeue_after == pytest.approx(1)
    d = run(j(d.status), all_pods(actor=backoff), now=T0 + timedelta(seconds=120))
    assert outcome_of(d) == ("Failed", "ImagePullFailed") and d.status.phase == "Draining"
    message = cond(d.status, "Failed").message
    assert "spec.actor.image" in message and "'localhost/rlkube/nope:1'" in message and "j-actor-0" in message
    assert "connection refused" in message and "spec.runPolicy.imagePullTimeoutSeconds" in message
    assert "Warning" in [e.type for e in d.events if e.reason == "ImagePullFailed"]


def test_a_pull_that_recovers_starts_the_clock_again_and_a_zero_timeout_waits():
    """A large image whose pull fails once after minutes of progress gets the whole timeout again: the clock
    starts at the failure, and a pod no longer failing is forgotten."""
    st = running_status()
    d = run(job(st), all_pods(inference=pulling("inference", "ErrImagePull")), now=T0)
    d = run(job(d.status), all_pods(inference=pod("inference", phase="Pending", ready=False,
                                                  waiting_reason="ContainerCreating")), now=T0 + timedelta(seconds=200))
    assert d.status.components["inference"].pull_failing_since == {}
    later = T0 + timedelta(seconds=400)
    d = run(job(d.status), all_pods(inference=pulling("inference", "ErrImagePull")), now=later)
    assert outcome_of(d) is None and d.requeue_after == pytest.approx(300)  # the default timeout, from `later`
    d = run(job(d.status), all_pods(inference=pulling("inference", "ErrImagePull")), now=later + timedelta(seconds=300))
    assert outcome_of(d) == ("Failed", "ImagePullFailed")
    assert "spec.image" in cond(d.status, "Failed").message  # the job's image: inference.image is unset
    waits = job(st, **{"runPolicy.imagePullTimeoutSeconds": 0})
    d = run(waits, all_pods(inference=pulling("inference", "ErrImagePull")), now=T0)
    d = run(job(d.status, **{"runPolicy.imagePullTimeoutSeconds": 0}),
            all_pods(inference=pulling("inference", "ErrImagePull")), now=T0 + timedelta(days=1))
    assert outcome_of(d) is None  # 0: wait for the registry


@pytest.mark.parametrize("reason", ["InvalidImageName", "ErrImageNeverPull", "Init:ErrImageNeverPull"])
def test_an_image_no_retry_can_pull_fails_the_job_at_once(reason):
    d = run(job(running_status()), all_pods(trainer=pulling("trainer", reason)))
    assert outcome_of(d) == ("Failed", "ImagePullFailed") and reason in cond(d.status, "Failed").message


def test_pending_with_everything_created_creates_nothing_more():
    d = run(job(), [pod("redis", phase="Pending")])
    assert d.actions == [] and d.status.phase == "Pending"


def test_redis_ready_starts_trainer_and_inference_together_then_the_preprocessor():
    d = run(job(), [pod("redis")])
    assert d.status.phase == "Starting"
    assert creates(d) == ["j-trainer-0", "j-inference-0", "j-preprocessor-0"]  # POSTed in this order


def test_preprocessor_follows_trainer_and_inference_actors_wait_for_inference_ready():
    d = run(job(TrainingJobStatus(phase="Starting")), [pod("redis"), pod("inference", phase="Pending")])
    assert creates(d) == ["j-trainer-0", "j-preprocessor-0"]
    pending = [pod("redis"), pod("trainer", phase="Pending"), pod("inference", phase="Pending")]
    d = run(job(TrainingJobStatus(phase="Starting")), pending)
    assert creates(d) == ["j-preprocessor-0"]
    d = run(job(TrainingJobStatus(phase="Starting")), [pod("redis"), pod("trainer"), pod("inference", ready=False),
                                                       pod("preprocessor")])
    assert creates(d) == []
    d = run(job(TrainingJobStatus(phase="Starting")), [pod("redis"), pod("trainer"), pod("inference"),
                                                       pod("preprocessor")])
    assert creates(d) == ["j-actor-0"]


def test_all_components_ready_is_running():
    d = run(job(TrainingJobStatus(phase="Starting")), all_pods())
    assert d.status.phase == "Running" and d.status.reason == "AllComponentsReady"
    assert d.status.running_since == fmt_time(T0)
    assert all(cond(d.status, t).status == "True" for t in ("RedisReady", "TrainerReady", "ActorsReady"))
    assert "Running" in reasons(d)
    # Events are API writes: the one phase transition says it, not one Event per component or per first connection.
    assert not {"AllReady", "External", "Connected"} & set(reasons(d)) and reasons(d).count("Running") == 1


def test_the_event_source_has_an_event_when_it_recovers_not_when_it_first_connects():
    first = run(job(TrainingJobStatus(phase="Starting")), all_pods())
    assert cond(first.status, "EventSourceReachable").status == "True" and "Connected" not in reasons(first)
    lost = run(job(first.status), all_pods(), source=EventSource("Unreachable", "ConnectionError", "refused"))
    assert cond(lost.status, "EventSourceReachable").status == "False" and "ConnectionError" in reasons(lost)
    back = run(job(lost.status), all_pods())
    assert cond(back.status, "EventSourceReachable").status == "True" and "Connected" in reasons(back)


def test_a_trainer_event_means_running_even_if_a_component_is_not_ready():
    pods = all_pods(actor=pod("actor", ready=False))
    d = run(job(TrainingJobStatus(phase="Starting")), pods, [ev(protocol.WEIGHTS_READY, ms(T0), step=1)])
    assert d.status.phase == "Running" and d.status.reason == "TrainerReporting"


def test_running_does_not_go_back_when_a_component_turns_unready():
    d = run(job(running_status()), all_pods(inference=pod("inference", ready=False)))
    assert d.status.phase == "Running"
    assert cond(d.status, "InferenceReady").status == "False"


def test_external_redis_creates_no_redis_pod_service_or_secret():
    j = job(**{"redis.mode": "external", "redis.url": "redis://redis.example:6379/0"})
    d = run(j, static=())
    assert creates(d) == ["j-config", "j-inference", "j-trainer", "j-trainer-0", "j-inference-0", "j-preprocessor-0"]
    assert d.status.components["redis"].desired == 0


def test_a_missing_pod_of_a_running_job_is_recreated_without_gates():
    d = run(job(running_status()), all_pods(preprocessor=None, inference=pod("inference", ready=False)))
    assert creates(d) == ["j-preprocessor-0"]


# -- completion ---------------------------------------------------------------------------------------


FINISHED = {"step": 40, "checkpoint": "/checkpoints/step-40"}


def trainer_exited(code: int = 0) -> PodView:
    return pod("trainer", phase="Succeeded" if code == 0 else "Failed", exit_code=code)


def test_finished_event_and_trainer_exit_0_succeed_and_start_the_teardown():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                           **FINISHED)])
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")
    assert d.status.phase == "Draining"
    assert d.status.completion.stream_id == f"{ms(T0)}-0" and d.status.completion.final_step == 40
    assert d.status.completion.trainer_exit_code == 0 and d.status.completion.checkpoint == "/checkpoints/step-40"
    assert deletes(d) == [("j-actor-0", 10)]  # stage 1: actors, with their grace period
    assert cond(d.status, "ResourcesReleased").status == "False"
    assert creates(d) == []


def test_event_first_then_exit_succeeds():
    d = run(job(running_status()), all_pods(), [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)])
    assert outcome_of(d) is None and d.status.phase == "Running"
    assert d.requeue_after == pytest.approx(60)
    d = run(job(d.status), all_pods(trainer=trainer_exited(0)), now=T0 + timedelta(seconds=5))
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")


def test_exit_first_then_event_within_timeout_succeeds():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)))
    assert outcome_of(d) is None and d.status.completion.trainer_exit_code == 0
    later = T0 + timedelta(seconds=30)
    d = run(job(d.status), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(later), **FINISHED)],
            now=later)
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")


def test_exit_0_without_event_fails_after_completion_timeout():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)))
    d = run(job(d.status), all_pods(trainer=trainer_exited(0)), now=T0 + timedelta(seconds=59))
    assert outcome_of(d) is None and d.requeue_after == pytest.approx(1)
    d = run(job(d.status), all_pods(trainer=trainer_exited(0)), now=T0 + timedelta(seconds=60))
    assert outcome_of(d) == ("Failed", "TrainerExitedWithoutFinishedEvent")
    assert d.status.phase == "Draining" and "TrainerExitedWithoutFinishedEvent" in reasons(d)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"step": 40, "checkpoint": "/c/40"}, ("Succeeded", "TrainingFinished")),
        ({"step": 40}, ("Failed", "TrainerDidNotExit")),  # no checkpoint reported
        ({"step": 12, "checkpoint": "/c/12"}, ("Failed", "TrainerDidNotExit")),  # not the final step
    ],
)
def test_event_without_exit_within_completion_timeout(payload, expected):
    d = run(job(running_status()), all_pods(), [ev(protocol.TRAINING_FINISHED, ms(T0), **payload)])
    d = run(job(d.status), all_pods(), now=T0 + timedelta(seconds=59))
    assert outcome_of(d) is None
    d = run(job(d.status), all_pods(), now=T0 + timedelta(seconds=60))
    assert outcome_of(d) == expected
    assert d.status.completion.trainer_exit_code is None
    # The trainer is still running: the teardown will stop it in its stage (stage 1 now: actors).
    assert deletes(d) == [("j-actor-0", 10)]


@pytest.mark.parametrize("payload", [{"step": 17, "checkpoint": "/c/17"}, {"step": 40, "interrupted": True}])
def test_interrupted_training_finished_with_exit_0_is_not_a_success(payload):
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                           **payload)])
    assert outcome_of(d) == ("Failed", "TrainingInterrupted")
    assert d.status.completion.interrupted is True


def test_fast_llm_finished_event_without_step_uses_the_last_weights_ready_step():
    events = [ev(protocol.WEIGHTS_READY, ms(T0) - 5, step=40, documents_seen=1280),
              ev(protocol.TRAINING_FINISHED, ms(T0))]
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), events)
    assert outcome_of(d) == ("Succeeded", "TrainingFinished") and d.status.completion.final_step == 40


# -- trainer failures -------------------------------------------------------------------------------


def test_failed_trainer_with_retries_left_is_replaced_and_recreated_from_its_checkpoint():
    status = running_status()
    status.trainer.last_checkpoint = CheckpointRef(step=10, path="/checkpoints/step-10")
    failed = trainer_exited(1)
    d = run(job(status, **{"runPolicy.restartPolicy.trainer": "Never"}), all_pods(trainer=failed))
    assert outcome_of(d) is None and d.status.phase == "Running"
    assert deletes(d) == [("j-trainer-0", 0)]
    assert d.status.trainer_restarts == 1 and d.status.components["trainer"].replaced_pods == [failed.uid]
    assert any(e.reason == "TrainerRestarted" and "checkpoint step 10" in e.message for e in d.events)
    # The same failed pod seen again (the watch has not caught up): counted once, deleted again, no duplicate.
    again = run(job(d.status, **{"runPolicy.restartPolicy.trainer": "Never"}), all_pods(trainer=failed))
    assert again.status.trainer_restarts == 1 and "TrainerRestarted" not in reasons(again)
    # Once it is gone, the next pass recreates it with the checkpoint it should resume from.
    gone = run(job(again.status, **{"runPolicy.restartPolicy.trainer": "Never"}), all_pods(trainer=None))
    (new,) = [a.manifest for a in gone.actions if isinstance(a, Create)]
    assert new["metadata"]["name"] == "j-trainer-0"
    assert new["metadata"]["annotations"]["rlkube.io/resume-from-checkpoint"] == "/checkpoints/step-10"
    assert gone.status.trainer_restarts == 1


def test_backoff_limit_is_the_number_of_retries_allowed():
    j = lambda st: job(st, **{"runPolicy.backoffLimit": 1, "runPolicy.restartPolicy.trainer": "Never"})
    first = trainer_exited(1)
    d = run(j(running_status()), all_pods(trainer=first))
    assert outcome_of(d) is None and deletes(d) == [("j-trainer-0", 0)]  # retry 1 of 1
    d = run(j(d.status), all_pods(trainer=None))
    second = pod("trainer", phase="Failed", exit_code=1, uid="uid-second")
    d = run(j(d.status), all_pods(trainer=second))
    assert outcome_of(d) == ("Failed", "BackoffLimitExceeded") and d.status.trainer_restarts == 1


def test_trainer_restart_in_place_is_counted_and_the_job_continues():
    d = run(job(running_status()), all_pods(trainer=pod("trainer", restart_count=1)))
    assert outcome_of(d) is None and d.status.trainer_restarts == 1 and "TrainerRestarted" in reasons(d)
    assert d.actions == []


@pytest.mark.parametrize(
    ("backoff", "trainer"),
    [(0, trainer_exited(1)), (0, pod("trainer", restart_count=1)), (2, pod("trainer", restart_count=3))],
)
def test_trainer_failures_beyond_backoff_limit_fail_the_job(backoff, trainer):
    d = run(job(running_status(), **{"runPolicy.backoffLimit": backoff}), all_pods(trainer=trainer))
    assert outcome_of(d) == ("Failed", "BackoffLimitExceeded")
    assert f"backoffLimit is {backoff}" in cond(d.status, "Failed").message
    assert creates(d) == [] and ("j-trainer-0", 0) not in deletes(d)


def test_a_trainer_restart_voids_a_finished_event_it_published_before():
    d = run(job(running_status()), all_pods(), [ev(protocol.TRAINING_FINISHED, ms(T0), step=17, interrupted=True)])
    assert d.status.completion.stream_id is not None
    d = run(job(d.status), all_pods(trainer=pod("trainer", restart_count=1)), now=T0 + timedelta(seconds=1))
    assert d.status.completion is None and "StaleFinishedEvent" in reasons(d)
    # ... also when the event is only read after the restart was seen (its time predates the new container).
    restarted = pod("trainer", restart_count=1, started_at=T0 + timedelta(seconds=2))
    d = run(job(d.status), all_pods(trainer=restarted), [ev(protocol.TRAINING_FINISHED, ms(T0) + 500, step=17)],
            now=T0 + timedelta(seconds=3))
    assert d.status.completion is None


def test_a_trainer_killed_after_its_full_finish_succeeds_on_the_event_its_restart_reports():
    """Killed between training_finished and exit: the old event is void, the restarted trainer (resumed at
    maxSteps) reports the finish again and exits 0, and only that completes the job."""
    d = run(job(running_status()), all_pods(), [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)])
    killed = pod("trainer", restart_count=1, started_at=T0 + timedelta(seconds=2))
    d = run(job(d.status), all_pods(trainer=killed), now=T0 + timedelta(seconds=3))
    assert d.status.completion is None and outcome_of(d) is None
    again = T0 + timedelta(seconds=5)
    done = pod("trainer", phase="Succeeded", exit_code=0, restart_count=1, started_at=T0 + timedelta(seconds=2))
    d = run(job(d.status), all_pods(trainer=done), [ev(protocol.TRAINING_FINISHED, ms(again), **FINISHED)],
            now=again)
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")
    assert d.status.completion.stream_id == f"{ms(again)}-0" and d.status.completion.final_step == 40


# -- other components -------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["Failed", "Succeeded"])
def test_an_actor_that_ends_before_training_finished_is_replaced_and_the_job_continues(phase):
    actor = pod("actor", phase=phase, exit_code=2 if phase == "Failed" else 0)
    d = run(job(running_status()), all_pods(actor=actor))
    assert outcome_of(d) is None and d.status.phase == "Running"
    assert deletes(d) == [("j-actor-0", 0)] and "ComponentRestarted" in reasons(d)
    assert d.status.components["actor"].restarts == 1 and d.status.trainer_restarts == 0
    d = run(job(d.status), all_pods(actor=None))
    assert creates(d) == ["j-actor-0"]


@pytest.mark.parametrize(
    "source",
    [
        # Right after an operator restart: the watcher has not read the stream yet.
        EventSource("Reachable", "Connected", "redis://10.0.0.9:6379/0", caught_up=False),
        # The CI window: the watcher had read to the end long ago and sits in a blocked XREAD whose reply (the
        # training_finished that stopped the producers) the operator has not applied yet, when the pods' exit
        # arrives. Only a read made in this pass, after the pods were seen, tells.
        REACHABLE,
        # Redis unreachable: nothing can be read, so nothing is judged.
        EventSource("Unreachable", "ConnectionError", "redis://10.0.0.9:6379/0: refused"),
    ],
    ids=["not-caught-up", "caught-up-but-no-fresh-read", "unreachable"],
)
@pytest.mark.parametrize("role", ["actor", "preprocessor"])
def test_a_producer_that_exited_0_is_not_replaced_without_a_fresh_read_to_the_stream_end(source, role):
    done = pod(role, phase="Succeeded", exit_code=0)
    d = run(job(running_status()), all_pods(**{role: done}), source=source, read_to_end=False)
    assert deletes(d) == [] and creates(d) == [] and "ComponentRestarted" not in reasons(d)
    assert d.status.components[role].restarts == 0
    assert d.requeue_after is not None and d.requeue_after <= 2.0  # looks again soon
    # The fresh read finds the event: the exit 0 was the normal stop, nothing is replaced.
    d = run(job(d.status), all_pods(**{role: done}), [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)])
    assert deletes(d) == [] and d.status.completion.stream_id is not None


def test_producers_may_exit_0_once_training_finished_was_published():
    finished = [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)]
    d = run(job(running_status()), all_pods(actor=pod("actor", phase="Succeeded", exit_code=0)), finished)
    assert deletes(d) == [] and outcome_of(d) is None


# -- stall and event source ---------------------------------------------------------------------------


def test_no_trainer_event_for_event_timeout_sets_stalled_and_events_clear_it():
    status = running_status()  # Running since T0 - 2 min, event timeout 300 s: stalled from T0 + 180 s
    d = run(job(status), all_pods(), now=T0 + timedelta(seconds=170))
    assert cond(d.status, "Stalled").status == "False" and d.requeue_after == pytest.approx(10)
    d = run(job(d.status), all_pods(), now=T0 + timedelta(seconds=240))
    stalled = cond(d.status, "Stalled")
    assert stalled.status == "True" and stalled.reason == "NoTrainerEvents" and outcome_of(d) is None
    assert any(e.type == "Warning" and e.reason == "NoTrainerEvents" for e in d.events)
    later = T0 + timedelta(seconds=250)
    d = run(job(d.status), all_pods(), [ev(protocol.WEIGHTS_READY, ms(later), step=3)], now=later)
    assert cond(d.status, "Stalled").status == "False" and cond(d.status, "Stalled").reason == "EventsResumed"


def test_stall_fails_the_job_with_fail_on_stall():
    d = run(job(running_status(), **{"runPolicy.failOnStall": True}), all_pods(), now=T0 + timedelta(seconds=240))
    assert outcome_of(d) == ("Failed", "Stalled")


def test_event_timeout_0_disables_the_stall_check():
    j = lambda st: job(st, **{"runPolicy.eventTimeoutSeconds": 0})
    d = run(j(None), all_pods(), now=T0)
    d = run(j(d.status), all_pods(), now=T0 + timedelta(days=1))
    assert d.status.phase == "Running" and cond(d.status, "Stalled") is None and outcome_of(d) is None
    assert d.requeue_after is None


@pytest.mark.parametrize(
    ("source", "status", "reason"),
    [
        (EventSource("Unreachable", "ConnectionError", "Error 111 connecting"), "False", "ConnectionError"),
        (EventSource("Unreachable", "AuthenticationError", "invalid password"), "False", "AuthenticationError"),
        (EventSource(), "Unknown", "WaitingForRedis"),
        (REACHABLE, "True", "Connected"),
    ],
)
def test_event_source_reachability_is_a_condition_with_its_reason(source, status, reason):
    d = run(job(running_status()), all_pods(), source=source)
    c = cond(d.status, "EventSourceReachable")
    assert (c.status, c.reason) == (status, reason)
    if status == "False":
        assert any(e.type == "Warning" and e.reason == reason for e in d.events)
        assert d.status.phase == "Running"  # unreachable alone decides nothing; the stall clock does


# -- events ---------------------------------------------------------------------------------------


def test_trainer_progress_checkpoints_and_skipped_entries_are_recorded():
    events = [
        ev(protocol.WEIGHTS_READY, 1000, step=5, documents_seen=160),
        ev(protocol.CHECKPOINT_SAVED, 1001, step=5, path="/checkpoints/step-5"),
        ev(protocol.METRICS, 1002, step=5, lag_max=1, loss=0.3),
    ]
    d = run(job(running_status()), all_pods(), events, read_upto="1005-0")
    tr = d.status.trainer
    assert (tr.step, tr.weights_version, tr.documents_seen) == (5, 5, 160)
    assert tr.last_checkpoint == CheckpointRef(step=5, path="/checkpoints/step-5")
    assert d.status.lag == 1 and d.status.progress == "5/40"
    assert tr.last_event_id == "1005-0"  # past the malformed entries the watcher skipped
    # Re-delivered events (an operator restart re-reads after lastEventId) change nothing.
    again = run(job(d.status), all_pods(), [ev(protocol.WEIGHTS_READY, 1000, step=1)])
    assert again.status.trainer.step == 5


def test_reward_and_throughput_of_metrics_events_are_recorded_rounded_and_kept_when_missing():
    d = run(job(running_status()), all_pods(),
            [ev(protocol.METRICS, 1000, step=5, lag_max=2, reward_mean=0.123456, tokens_per_s=1234.56)])
    tr = d.status.trainer
    assert (tr.reward_mean, tr.tokens_per_second, d.status.lag) == (0.1235, 1234.6, 2)
    # A metrics event without them (or with values JSON cannot carry) leaves the last reported ones.
    later = run(job(d.status), all_pods(),
                [ev(protocol.METRICS, 1001, step=6, lag_max=1, reward_mean=float("nan")), ev(protocol.METRICS, 1002, step=6)])
    tr = later.status.trainer
    assert (tr.reward_mean, tr.tokens_per_second, later.status.lag, tr.step) == (0.1235, 1234.6, 1, 6)


# -- suspend, delete, invalid, terminal -----------------------------------------------------------------


def test_suspend_stops_in_order_then_resume_recreates():
    j = lambda st, **kw: job(st, **{"runPolicy.suspend": True}, **kw)
    d = run(j(running_status()), all_pods())
    assert d.status.phase == "Suspended" and d.status.reason == "Suspending"
    assert d.status.teardown.reason == "Suspended" and deletes(d) == [("j-actor-0", 10)]
    assert outcome_of(d) is None
    d = run(j(d.status), [])
    assert d.status.phase == "Suspended" and cond(d.status, "Suspended").status == "True"
    assert cond(d.status, "ResourcesReleased").status == "True" and not d.watch_events
    assert {(a.kind, a.name) for a in d.actions if isinstance(a, DeleteObject)} == {
        ("ConfigMap", "j-config"), ("Secret", "j-redis"), ("NetworkPolicy", "j-redis"), ("Service", "j-redis"),
        ("Service", "j-inference"), ("Service", "j-trainer")}
    d = run(job(d.status), [], static=())  # suspend unset
    assert d.status.phase == "Pending" and d.status.teardown is None
    assert cond(d.status, "Suspended").status == "False" and cond(d.status, "ResourcesReleased") is None
    assert creates(d)[-1] == "j-redis" and "Secret" in [a.kind for a in d.actions]


def test_deleting_a_running_job_runs_the_teardown_and_reports_released():
    d = run(job(running_status(), deleting=True), all_pods())
    assert d.status.phase == "Draining" and d.status.teardown.reason == "Deleted"
    assert not d.released and deletes(d) == [("j-actor-0", 10)] and outcome_of(d) is None
    d = run(job(d.status, deleting=True), [])
    assert d.released and d.status.teardown.stage == "Done"
    assert [s.name for s in d.status.teardown.stages] == list(TEARDOWN_ORDER)


def test_a_stage_counts_the_pods_it_deletes_as_stopped_so_their_deletion_event_changes_nothing():
    d = run(job(running_status(), deleting=True), all_pods())
    assert deletes(d) == [("j-actor-0", 10)] and d.status.components["actor"].ready == 0
    # The next pass sees the actor's deletionTimestamp: nothing new to write (no status PATCH for it).
    again = run(job(d.status, deleting=True), all_pods(actor=pod("actor", deleting=True, deletion_grace=10)))
    assert again.status == d.status and deletes(again) == []


def test_invalid_spec_fails_names_the_field_and_creates_nothing():
    d = run(job(**{"model.path": "builtin://tiny-gpt"}), static=())
    assert outcome_of(d) == ("Failed", "InvalidSpec")
    assert "spec.model.path" in cond(d.status, "Failed").message
    assert creates(d) == [] and d.status.phase == "Failed" and d.released
    assert any(e.type == "Warning" and e.reason == "InvalidSpec" for e in d.events)


def test_a_terminal_job_never_recreates_anything_and_ignores_new_events():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                           **FINISHED)])
    for _ in range(6):  # pods disappear stage by stage
        d = run(job(d.status), [])
    assert d.status.phase == "Succeeded" and d.finished
    done = d.status
    d = run(job(done), [pod("trainer", phase="Failed", exit_code=1)],
            [ev(protocol.TRAINING_FINISHED, ms(T0) + 99_000, step=3)], now=T0 + timedelta(hours=1))
    assert outcome_of(d) == ("Succeeded", "TrainingFinished") and d.status.phase == "Succeeded"
    assert creates(d) == [] and deletes(d) == [] and d.status.completion == done.completion


def test_a_successful_teardown_posts_one_event_at_its_end_listing_the_stages():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                           **FINISHED)])
    # Events are API writes: the transition says why the job ends; no Event for the finished event or the exit.
    assert [(e.reason, e.message) for e in d.events] == [
        ("Draining", "Running -> Draining: TrainingFinished trained 40/40 steps")]
    events = []
    for _ in range(6):  # pods disappear stage by stage: no Event per stage
        d = run(job(d.status), [])
        events += d.events
    assert d.status.phase == "Succeeded" and cond(d.status, "ResourcesReleased").status == "True"
    [final] = events
    assert final.reason == "Succeeded" and final.message.startswith(
        "Draining -> Succeeded: TrainingFinished trained 40/40 steps; teardown (Succeeded) finished: actor stopped in")
    assert [role for role in TEARDOWN_ORDER if f"{role} stopped in" in final.message] == list(TEARDOWN_ORDER)
    assert final.message.count(" stopped in ") == len(TEARDOWN_ORDER)


def test_a_deletion_posts_its_own_released_event():
    d = run(job(running_status(), deleting=True), all_pods())
    while not d.released:
        d = run(job(d.status, deleting=True), [])
    released = [e for e in d.events if e.reason == "AllPodsGone"]
    assert len(released) == 1 and "teardown (Deleted) finished: actor stopped in" in released[0].message


def test_deleting_a_finished_job_releases_it_at_once():
    d = run(job(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                           **FINISHED)])
    for _ in range(6):
        d = run(job(d.status), [])
    d = run(job(d.status, deleting=True), [])
    assert d.released and d.actions == [] and d.status.phase == "Succeeded"


def test_ttl_after_finished_deletes_the_job():
    j = lambda st, **kw: job(st, **{"runPolicy.ttlSecondsAfterFinished": 30}, **kw)
    d = run(j(running_status()), all_pods(trainer=trainer_exited(0)), [ev(protocol.TRAINING_FINISHED, ms(T0),
                                                                         **FINISHED)])
    for _ in range(6):
        d = run(j(d.status), [])
    assert d.status.phase == "Succeeded" and not d.finished and d.requeue_after == pytest.approx(30)
    d = run(j(d.status), [], now=T0 + timedelta(seconds=31))
    assert any(isinstance(a, DeleteJob) for a in d.actions)


def test_external_redis_streams_are_deleted_in_the_last_stage():
    j = lambda st, **kw: job(st, **{"redis.mode": "external", "redis.url": "redis://r:6379/0"}, **kw)
    d = run(j(None, deleting=True), [])
    (streams,) = [a for a in d.actions if isinstance(a, DeleteStreams)]
    assert streams.keys == tuple(protocol.StreamKeys.for_job("ns", "j").all())
    assert {"ns/j/fast_llm_events", "ns/j/fast_llm_streaming", "ns/j/rollouts"} <= set(streams.keys)


# -- children deleted by hand: recreated while the job runs, never once it is decided or torn down -----


@pytest.mark.parametrize("missing", sorted(ALL_STATIC))
@pytest.mark.parametrize("phase", ["Pending", "Starting", "Running"])
def test_a_static_child_deleted_while_the_job_runs_is_recreated_with_an_event(missing, phase):
    status = running_status(phase=phase)
    d = run(job(status), all_pods(), static=ALL_STATIC - {missing})
    kind, name = missing.split("/")
    assert [(a.kind, a.name) for a in d.actions if isinstance(a, Create)] == [(kind, name)]
    made = next(a for a in d.actions if isinstance(a, Create))
    assert made.manifest["metadata"]["ownerReferences"][0]["uid"] == "uid-j"
    assert made.manifest["metadata"]["labels"]["rlkube.io/job-name"] == "j"
    recreated = [e for e in d.events if e.reason == "ChildRecreated"]
    assert len(recreated) == 1 and recreated[0].type == "Warning" and f"{kind} {name}" in recreated[0].message
    assert outcome_of(d) is None and d.status.teardown is None


def test_first_creation_and_resume_are_not_reported_as_recreations():
    d = run(job(), static=())
    assert len(creates(d)) == 7 and "ChildRecreated" not in reasons(d)
    j = lambda st: job(st, **{"runPolicy.suspend": True})
    d = run(j(running_status()), all_pods())
    d = run(j(d.status), [])
    assert d.status.phase == "Suspended"
    d = run(job(d.status), [], static=())
    assert "Secret" in [a.kind for a in d.actions] and "ChildRecreated" not in reasons(d)


def _decided_statuses() -> dict[str, TrainingJobStatus]:
    finished = [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)]
    draining = run(job(running_status()), all_pods(trainer=trainer_exited(0)), finished)
    assert draining.status.phase == "Draining"
    d = draining
    for _ in range(6):
        d = run(job(d.status), [])
    failed = run(job(running_status(), **{"runPolicy.backoffLimit": 0}), all_pods(trainer=trainer_exited(1)))
    assert failed.status.phase == "Draining" and outcome_of(failed) == ("Failed", "BackoffLimitExceeded")
    return {"draining": draining.status, "succeeded": d.status, "failing": failed.status}


@pytest.mark.parametrize("which", ["draining", "succeeded", "failing", "deleting", "suspending"])
def test_a_decided_or_tearing_down_job_never_recreates_a_deleted_child(which):
    if which == "deleting":
        j = job(running_status(), deleting=True)
    elif which == "suspending":
        j = job(running_status(), **{"runPolicy.suspend": True})
    else:
        j = job(_decided_statuses()[which])
    d = run(j, all_pods(actor=None, preprocessor=None), static=())
    assert creates(d) == [] and "ChildRecreated" not in reasons(d)


# -- spec changes while the job runs: reported once, not applied ---------------------------------------


def test_a_spec_change_while_running_is_reported_once_and_not_applied():
    started = running_status()
    assert started.started_spec["algorithm"]["maxSteps"] == 40 and started.started_generation == 1
    changed = lambda st, gen=2, **kw: job(st, generation=gen, changed=True, **{"algorithm.maxSteps": 80, **kw})
    d = run(changed(started), all_pods())
    warned = [e for e in d.events if e.reason == "SpecChangeIgnored"]
    assert len(warned) == 1 and warned[0].type == "Warning"
    assert warned[0].message.startswith("spec.algorithm.maxSteps changed after the job started (generation 1 -> 2)")
    c = cond(d.status, "SpecChangeIgnored")
    assert c.status == "True" and c.message == warned[0].message and c.observed_generation == 2
    assert d.status.observed_generation == 2 and d.status.trainer.max_steps == 40
    assert d.status.started_spec["algorithm"]["maxSteps"] == 40 and creates(d) == []
    # The next passes (another edit of the same field included) say nothing new.
    d = run(changed(d.status, gen=3, **{"algorithm.maxSteps": 81}), all_pods())
    assert "SpecChangeIgnored" not in reasons(d) and "(generation 1 -> 3)" in cond(d.status, "SpecChangeIgnored").message
    # One more field: reported again, naming both.
    d = run(changed(d.status, gen=4, **{"actor.replicas": 2}), all_pods())
    msg = next(e.message for e in d.events if e.reason == "SpecChangeIgnored")
    assert msg.startswith("spec.actor.replicas, spec.algorithm.maxSteps changed")
    assert creates(d) == []  # no second actor: the job runs the spec it started with
    # The job finishes by the maxSteps it started with.
    d = run(changed(d.status, gen=4, **{"actor.replicas": 2}), all_pods(trainer=trainer_exited(0)),
            [ev(protocol.TRAINING_FINISHED, ms(T0), **FINISHED)])
    assert outcome_of(d) == ("Succeeded", "TrainingFinished") and "40/40" in cond(d.status, "Succeeded").message


def test_a_spec_change_undone_clears_the_condition_and_suspend_is_not_a_change():
    d = run(job(running_status(), generation=2, changed=True, **{"algorithm.temperature": 0.5}), all_pods())
    assert cond(d.status, "SpecChangeIgnored").status == "True"
    d = run(job(d.status, generation=3, changed=True), all_pods())
    assert cond(d.status, "SpecChangeIgnored").status == "False" and "SpecChangeIgnored" not in reasons(d)
    d = run(job(running_status(), generation=2, changed=True, **{"runPolicy.suspend": True}), all_pods())
    assert cond(d.status, "SpecChangeIgnored") is None and d.status.teardown.reason == "Suspended"


def test_an_invalid_spec_edit_of_a_running_job_is_ignored_not_fatal():
    d = run(job(running_status(), generation=2, changed=True, **{"model.path": "builtin://tiny-gpt"}), all_pods())
    assert outcome_of(d) is None and d.status.phase == "Running"
    assert cond(d.status, "SpecChangeIgnored").message.startswith("spec.model.path changed")


def test_resume_applies_the_changed_spec():
    j = lambda st, **kw: job(st, generation=2, changed=True, **{"runPolicy.suspend": True, "actor.replicas": 2}, **kw)
    d = run(j(running_status()), all_pods())
    d = run(j(d.status), [])
    assert d.status.phase == "Suspended" and cond(d.status, "SpecChangeIgnored") is None  # not running: no report
    d = run(job(d.status, generation=3, changed=True, **{"actor.replicas": 2}), [], static=())
    assert d.status.phase == "Pending" and d.status.started_spec["actor"]["replicas"] == 2
    assert d.status.started_generation == 3 and cond(d.status, "SpecChangeIgnored") is None


# -- a child the API server rejects as invalid ---------------------------------------------------------


def test_a_child_rejected_as_invalid_fails_the_job_creates_nothing_more_and_tears_down():
    message = 'Pod "j-actor-0" is invalid: spec.containers[0].image: Invalid value: "x ": must not have ...'
    rejected = Rejected("Pod", "j-actor-0", message)
    status = running_status(phase="Starting")
    d = run(job(status), all_pods(actor=None), rejected=rejected)
    assert outcome_of(d) == ("Failed", "InvalidSpec") and creates(d) == []
    failed = cond(d.status, "Failed")
    assert failed.message == f"the API server rejected Pod j-actor-0: {message}"
    assert any(e.type == "Warning" and e.reason == "InvalidSpec" and "spec.containers[0].image" in e.message
               for e in d.events)
    # The usual teardown: no actor to stop, so the preprocessor stage is the first to delete.
    assert d.status.teardown.reason == "Failed" and deletes(d) == [("j-preprocessor-0", 10)]
    for _ in range(6):
        d = run(job(d.status), [])
        assert creates(d) == []
    assert d.status.phase == "Failed" and d.status.reason == "InvalidSpec" and d.status.message == failed.message


@pytest.mark.parametrize(
    ("resources", "field", "says"),
    [
        ({"requests": {"cpu": "2 cores"}}, "spec.actor.resources.requests.cpu", "not a quantity"),
        ({"limits": {"memory": "1ki"}}, "spec.actor.resources.limits.memory", "not a quantity"),
        ({"requests": {"cpu": -1}}, "spec.actor.resources.requests.cpu", "negative"),
        ({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}, "spec.actor.resources.requests.cpu", "limit"),
        ({"requests": {"gpu": 1}}, "spec.actor.resources.requests.gpu", "unknown resource"),
    ],
)
def test_resources_the_pod_schema_would_reject_fail_up_front_naming_the_field(resources, field, says):
    d = run(job(**{"actor.resources": resources}), static=())
    assert outcome_of(d) == ("Failed", "InvalidSpec") and creates(d) == []
    message = cond(d.status, "Failed").message
    assert field in message and says in message


@pytest.mark.parametrize(
    "resources",
    [{"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 1, "memory": "1.5Gi"}},
     # (hugepages need cpu or memory beside them, an extended resource an equal limit: the API server refuses
     # such a Pod)
     {"requests": {"ephemeral-storage": "1e3", "example.com/fpga": 1},
      "limits": {"hugepages-2Mi": "2Mi", "memory": "1Gi", "example.com/fpga": 1}}],
)
def test_valid_resources_pass(resources):
    parse_spec(raw_spec(**{"actor.resources": resources}))


FAST_LLM = {"trainer.backend": "fast-llm", "trainer.gpusPerNode": 1, "trainer.fastLlm": {"modelFormat": "llama"},
            "model.path": "/models/m"}


@pytest.mark.parametrize("last_weights_ready", [40, 39])
def test_fast_llm_finished_event_is_the_final_step_even_when_the_last_update_was_skipped(last_weights_ready):
    """Fast-LLM publishes no weights_ready for an unsuccessful (skipped) update, and its training_finished has no
    step: the last weights_ready may read 39 of 40. Its training_finished stands for train_iters steps done and
    the final checkpoint saved under run.experiment_dir (rlkube.controller.manifests.fastllm.finished)."""
    events = [ev(protocol.WEIGHTS_READY, ms(T0) - 5, step=last_weights_ready, documents_seen=1280),
              ev(protocol.TRAINING_FINISHED, ms(T0))]
    d = run(job(running_status(), **FAST_LLM), all_pods(trainer=trainer_exited(0)), events)
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")
    assert d.status.completion.final_step == 40 and d.status.completion.interrupted is False
    assert d.status.completion.checkpoint == "/checkpoints/checkpoint/40"  # Fast-LLM's layout, not ours
    # Its event without the trainer's exit: the final step and checkpoint it stands for make it a success too.
    d = run(job(running_status(), **FAST_LLM), all_pods(), events)
    d = run(job(d.status, **FAST_LLM), all_pods(), now=T0 + timedelta(seconds=60))
    assert outcome_of(d) == ("Succeeded", "TrainingFinished")
