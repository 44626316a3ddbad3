"""Per-job metrics from the status (rlkube.controller.reconcile.jobmetrics), read back through the Prometheus text
format.

Each test uses its own registry and a fixed clock; the integration test (tests/integration/
test_operator_metrics.py) scrapes the operator's real endpoint during a job and compares with the API server.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rlkube.api.status import TrainingJobStatus
from rlkube.controller.reconcile.jobmetrics import PHASES, PREFIX, JobStatusCollector

NOW = datetime(2025, 1, 1, 12, 0, 30, tzinfo=UTC).timestamp()


def status(**fields) -> TrainingJobStatus:
    return TrainingJobStatus.model_validate(fields)


def scrape(collector: JobStatusCollector) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def key(name: str, job: str = "j", **labels) -> tuple[str, tuple]:
    return PREFIX + name, tuple(sorted({"namespace": "ns", "trainingjob": job, **labels}.items()))


RUNNING = dict(
    phase="Running",
    lag=2,
    trainer={"step": 7, "maxSteps": 40, "weightsVersion": 7, "rewardMean": 0.3125, "tokensPerSecond": 812.5,
             "lastEventTime": "2025-01-01T12:00:18.250Z"},
    components={"trainer": {"restarts": 1, "desired": 1}, "actor": {"restarts": 3, "desired": 2}},
)


def test_a_running_job_exposes_what_its_status_says():
    c = JobStatusCollector(clock=lambda: NOW)
    c.observe("ns", "j", status(**RUNNING))
    got = scrape(c)
    for p in PHASES:
        assert got[key("status_phase", phase=p)] == (1.0 if p == "Running" else 0.0)
    assert got[key("step")] == 7 and got[key("max_steps")] == 40 and got[key("weights_version")] == 7
    assert got[key("policy_lag")] == 2
    assert got[key("reward_mean")] == 0.3125 and got[key("tokens_per_second")] == 812.5
    assert got[key("seconds_since_last_trainer_event")] == 11.75  # computed at scrape time
    assert got[key("component_restarts", component="trainer")] == 1
    assert got[key("component_restarts", component="actor")] == 3
    assert not any(name == PREFIX + "teardown_stage_duration_seconds" for name, _ in got)


def test_seconds_since_the_last_event_grows_with_the_clock_without_a_new_status():
    now = [NOW]
    c = JobStatusCollector(clock=lambda: now[0])
    c.observe("ns", "j", status(**RUNNING))
    assert scrape(c)[key("seconds_since_last_trainer_event")] == 11.75
    now[0] += 60
    assert scrape(c)[key("seconds_since_last_trainer_event")] == 71.75


def test_values_never_reported_are_absent_not_zero():
    c = JobStatusCollector(clock=lambda: NOW)
    c.observe("ns", "j", status(phase="Pending", trainer={"maxSteps": 40}))
    got = scrape(c)
    assert got[key("step")] == 0 and got[key("max_steps")] == 40
    for name in ("policy_lag", "reward_mean", "tokens_per_second", "seconds_since_last_trainer_event"):
        assert not any(n == PREFIX + name for n, _ in got), name


def test_finished_teardown_stages_have_their_durations():
    stages = [
        {"name": "actor", "startedAt": "2025-01-01T12:00:00.000Z", "finishedAt": "2025-01-01T12:00:00.250Z"},
        {"name": "preprocessor", "startedAt": "2025-01-01T12:00:00.250Z", "finishedAt": "2025-01-01T12:00:02.000Z"},
        {"name": "inference", "startedAt": "2025-01-01T12:00:02.000Z"},  # running: no duration yet
    ]
    c = JobStatusCollector(clock=lambda: NOW)
    c.observe("ns", "j", status(phase="Draining", teardown={"reason": "Succeeded", "stage": "inference",
                                                              "stages": stages}))
    got = scrape(c)
    durations = {dict(labels)["stage"]: v for (name, labels), v in got.items()
                 if name == PREFIX + "teardown_stage_duration_seconds"}
    assert durations == {"actor": 0.25, "preprocessor": 1.75}


def test_the_latest_status_replaces_the_previous_and_a_forgotten_job_has_no_series():
    c = JobStatusCollector(clock=lambda: NOW)
    c.observe("ns", "j", status(**RUNNING))
    c.observe("ns", "other", status(phase="Pending"))
    c.observe("ns", "j", status(**{**RUNNING, "phase": "Succeeded", "trainer": {**RUNNING["trainer"], "step": 40}}))
    got = scrape(c)
    assert got[key("step")] == 40 and got[key("status_phase", phase="Succeeded")] == 1
    assert got[key("status_phase", phase="Running")] == 0
    c.forget("ns", "j")
    c.forget("ns", "never-seen")  # no error
    got = scrape(c)
    assert {dict(labels)["trainingjob"] for _, labels in got} == {"other"}


def test_agent_counters_of_the_status_are_gauges_named_after_their_counters():
    from rlkube.contract import counters
    from rlkube.controller.reconcile.jobmetrics import AGENT_PREFIX

    agent = {"episodes": 640, "turns": 1100, "toolCalls": 460, "toolErrors": 3, "toolTimeouts": 1,
             "sandboxRefusals": 2, "truncated": 40, "timedOut": 1, "drifted": 7, "turnRewardMean": 0.0625}
    c = JobStatusCollector(clock=lambda: NOW)
    c.observe("ns", "j", status(**RUNNING, agent=agent))
    c.observe("ns", "single-turn", status(**RUNNING))
    got = scrape(c)
    want = {"episodes": 640, "turns": 1100, "tool_calls": 460, "tool_errors": 3, "tool_timeouts": 1,
            "sandbox_refusals": 2, "truncated": 40, "timed_out": 1, "drifted": 7, "turn_reward_mean": 0.0625}
    assert set(want) == set(counters.AGENT_STATUS)
    assert {n: got[key(AGENT_PREFIX + n)] for n in want} == want
    # A job without an environment has no agent series (absent, not 0), nor one whose steps rewarded no turn yet.
    assert not any(n.startswith(PREFIX + AGENT_PREFIX) and dict(labels)["trainingjob"] == "single-turn"
                   for n, labels in got)
    c.observe("ns", "j", status(**RUNNING, agent={**agent, "turnRewardMean": None}))
    got = scrape(c)
    assert key(AGENT_PREFIX + "turn_reward_mean") not in got and got[key(AGENT_PREFIX + "tool_calls")] == 460
