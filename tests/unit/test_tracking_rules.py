"""spec.tracking without servers: the spec's fields, the run state a restarted trainer resumes, the fan-out's
failure handling (a failing or stuck sink never blocks the caller, is reported once, the others go on), the
redaction of secrets, the key's way into the trainer pod, and the one rule both launchers report a failed tracker by.
The real trackers are in tests/integration/roles/test_tracking.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from pydantic import ValidationError
from test_controller_decisions import T0, all_pods, cond, ev, job, run, running_status

from support import specs
from rlkube.api.spec import TrainingJobSpec
from rlkube.api.tracking import TrackingSpec
from rlkube.contract import protocol, runtime
from rlkube.controller.manifests import builders
from rlkube.core.tracking import Trackers
from rlkube.core.tracking.fanout import flatten, job_params, redact
from rlkube.core.tracking.run import RunState
from rlkube.lifecycle import progress, tracker_failures
from rlkube.lifecycle.environment import operator_env_names
from rlkube.lifecycle.validation import SpecError, parse_spec


def spec_with(tracking: dict, **overrides) -> TrainingJobSpec:
    return parse_spec(specs.spec(tracking=tracking, **overrides))


# -- the spec ------------------------------------------------------------------------------------------------------


def test_tracking_is_off_by_default_and_each_tracker_has_its_defaults():
    assert not parse_spec(specs.spec()).tracking.any
    t = spec_with({"mlflow": {"trackingUri": "http://mlflow:5000"}, "wandb": {"project": "p"}, "tensorboard": {}})
    assert t.tracking.mlflow.experiment_name == "rlkube"
    assert t.tracking.wandb.mode == "online" and t.tracking.wandb.api_key_secret is None
    assert t.tracking.tensorboard.directory == "tensorboard"


@pytest.mark.parametrize("tracking, field", [
    ({"mlflow": {"trackingUri": "mlflow:5000"}}, "trackingUri"),
    ({"mlflow": {}}, "trackingUri"),
    ({"mlflow": {"trackingUri": "https://me:hunter2@mlflow:5000"}}, "trackingUri"),  # credentials: not in a spec
    ({"wandb": {"project": "p", "baseUrl": "https://me:key@wandb.local"}}, "baseUrl"),
    ({"wandb": {"project": "p", "mode": "shared"}}, "mode"),
    ({"wandb": {"project": "p", "apiKey": "abc"}}, "apiKey"),  # the key itself has no field: a Secret reference only
    ({"wandb": {"project": "p", "apiKeySecret": {"name": "s"}}}, "key"),
    ({"tensorboard": {"directory": "../elsewhere"}}, "directory"),
    ({"tensorboard": {"directory": "/abs"}}, "directory"),
])
def test_bad_tracking_fields_are_refused_naming_the_field(tracking, field):
    with pytest.raises(SpecError) as err:
        spec_with(tracking)
    assert field in str(err.value)


def test_fast_llm_refuses_tracking_naming_the_field():
    with pytest.raises(SpecError) as err:
        spec_with({"tensorboard": {}}, **{"trainer.backend": "fast-llm", "trainer.gpusPerNode": 1,
                                          "trainer.fastLlm.modelFormat": "llama", "model.path": "/models/m",
                                          "inference.engine": "vllm"})
    assert "spec.tracking" in str(err.value)


def test_the_key_reaches_only_the_trainer_pod_and_only_by_reference():
    spec = spec_with({"wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "apiKey"}}})
    job_ref = builders.JobRef("ns", "j", "uid", spec, specs.spec())
    trainer = builders.core_pod(job_ref, "trainer", 0)
    env = {e["name"]: e for e in trainer["spec"]["containers"][0]["env"]}
    assert env[runtime.ENV_WANDB_API_KEY] == {"name": runtime.ENV_WANDB_API_KEY,
                                             "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "apiKey"}}}
    actor = builders.core_pod(job_ref, "actor", 0)
    assert runtime.ENV_WANDB_API_KEY not in {e["name"] for e in actor["spec"]["containers"][0]["env"]}
    assert runtime.ENV_WANDB_API_KEY in operator_env_names(spec, "trainer")  # a template may not override it
    assert runtime.ENV_WANDB_API_KEY not in operator_env_names(parse_spec(specs.spec()), "trainer")


# -- the run state -------------------------------------------------------------------------------------------------


def test_run_state_keeps_ids_and_logged_steps_per_tracker_across_restarts(tmp_path):
    first = RunState(tmp_path, "job")
    assert not first.resumed and first.run_id("wandb").startswith("job-")
    first.set_run_id("mlflow", "abc")
    first.mark("mlflow", {"train/loss": 1.0, "eval/reward_mean": 0.5}, 2)
    first.mark("tensorboard", {"train/loss": 1.0}, 1)

    again = RunState(tmp_path, "job")
    assert again.resumed and again.run_id("mlflow") == "abc" and again.run_id("wandb") == first.run_id("wandb")
    metrics = {"train/loss": 0.5, "eval/reward_mean": 0.7}
    assert again.unlogged("mlflow", metrics, 2) == {}  # step 2 of both series is in MLflow's run already
    assert again.unlogged("mlflow", metrics, 3) == metrics
    assert again.unlogged("tensorboard", metrics, 2) == metrics  # TensorBoard had taken only step 1 of train
    assert again.unlogged("wandb", metrics, 1) == metrics
    assert RunState(tmp_path / "other", "job").run_id("wandb") != first.run_id("wandb")  # another job's run


def test_a_new_job_on_a_reused_volume_starts_its_own_run(tmp_path):
    """The run state names its run (the TrainingJob's uid): the same job's restart resumes it, another job that
    finds the file on a reused claim starts a run of its own instead of logging into the earlier job's."""
    first = RunState(tmp_path, "job", uid="uid-1")
    first.set_run_id("mlflow", "abc")
    first.mark("mlflow", {"train/loss": 1.0}, 30)
    restarted = RunState(tmp_path, "job", uid="uid-1")
    assert restarted.resumed and restarted.run_id("mlflow") == "abc"
    other = RunState(tmp_path, "job", uid="uid-2")
    assert not other.resumed and other.run_id("mlflow") is None and other.run_id("wandb") != first.run_id("wandb")
    assert other.unlogged("mlflow", {"train/loss": 0.5}, 1) == {"train/loss": 0.5}
    assert RunState(tmp_path, "job", uid="uid-2").resumed  # the file is the new job's now


def test_an_unreadable_run_state_starts_a_new_run(tmp_path):
    (tmp_path / "run.json").write_text("{not json")
    state = RunState(tmp_path, "job")
    assert not state.resumed and state.run_id("mlflow") is None


# -- the fan-out ---------------------------------------------------------------------------------------------------


class Recording:
    def __init__(self, name: str, fail_on: str | None = None, block: threading.Event | None = None):
        self.name = name
        self.fail_on = fail_on
        self.block = block
        self.calls: list[tuple] = []
        self.closed: bool | None = None

    def _maybe(self, what: str) -> None:
        if self.block is not None:
            self.block.wait()
        if what == self.fail_on:
            raise ConnectionError(f"{self.name} refused {what}")

    def open(self) -> None:
        self._maybe("open")

    def log_params(self, params):
        self._maybe("log_params")
        self.calls.append(("params", params))

    def log_metrics(self, metrics, step):
        self._maybe("log_metrics")
        self.calls.append(("metrics", metrics, step))

    def log_table(self, name, rows, step):
        self._maybe("log_table")
        self.calls.append(("table", name, len(rows), step))

    def close(self, finished):
        self.closed = finished


def test_a_failing_sink_is_reported_once_and_the_others_get_everything(tmp_path):
    good, bad = Recording("good"), Recording("bad", fail_on="log_metrics")
    trackers = Trackers(run=RunState(tmp_path, "job"))
    trackers.add(good)
    trackers.add(bad)
    trackers.log_params({"a": 1})
    for step in (1, 2, 3):
        trackers.log_metrics({"train/loss": 1.0 / step, "train/none": None, "train/nan": float("nan"),
                              "train/flag": True}, step)
    trackers.log_table("samples", [{"x": 1}], 3)
    trackers.close()
    assert good.calls == [("params", {"a": 1}), ("metrics", {"train/loss": 1.0}, 1),
                          ("metrics", {"train/loss": 0.5}, 2), ("metrics", {"train/loss": 1 / 3}, 3),
                          ("table", "samples", 1, 3)]
    assert good.closed is True and bad.closed is None
    (failure,) = trackers.take_failures()
    assert failure.tracker == "bad" and "refused log_metrics" in failure.message
    assert trackers.take_failures() == []


def test_a_stuck_sink_never_blocks_the_caller_and_is_reported_when_closing(tmp_path):
    stuck = Recording("stuck", block=threading.Event())  # an unreachable server: every call hangs
    trackers = Trackers(run=RunState(tmp_path, "job"))
    trackers.add(stuck)
    caller = threading.Thread(target=lambda: [trackers.log_metrics({"train/loss": 1.0}, step)
                                              for step in range(1, 20_001)])  # more than the queue holds
    caller.start()
    caller.join(60)  # returns: the rest is dropped, never waited for (a blocked put would hang forever)
    assert not caller.is_alive() and trackers.workers[0].dropped > 0
    # The queue is full: close's wait for room and its wait for the worker share one bound, so the failure is in
    # by the time close returns (timeout_s + 1), for the trainer's last report.
    trackers.close(timeout_s=1.5)
    (failure,) = trackers.take_failures()
    assert failure.tracker == "stuck" and "not done" in failure.message
    stuck.block.set()


def test_no_tracker_configured_does_nothing():
    trackers = Trackers.none()
    trackers.log_params({"a": 1})
    trackers.log_metrics({"train/loss": 1.0}, 1)
    trackers.log_table("samples", [{"prompt": "p"}], 1)
    trackers.close()
    assert trackers.take_failures() == [] and trackers.workers == []


def test_failure_messages_lose_every_secret_the_trainer_holds():
    key = "k" * 40
    text = f"401 for https://user:{key}@host/api?key={key} and http://a:b@c"
    assert redact(text, (key,)) == "401 for https://[redacted]@host/api?key=[redacted] and http://[redacted]@c"


def test_params_are_the_spec_on_the_wire_flattened():
    spec = spec_with({"tensorboard": {}}, **{"algorithm.maxSteps": 7})
    params = job_params("ns", "j", spec)
    assert params["job.name"] == "j" and params["spec.algorithm.maxSteps"] == 7
    assert params["spec.tracking.tensorboard.directory"] == "tensorboard"
    assert flatten({"a": {"b": [1, 2]}, "c": 1}) == {"a.b": [1, 2], "c": 1}


# -- reporting: one rule for both launchers ------------------------------------------------------------------------


def test_a_tracker_failed_event_is_read_only_with_a_tracker_name():
    good = progress.read(protocol.TrainerEvent("1-0", protocol.TRACKER_FAILED,
                                               {"type": protocol.TRACKER_FAILED, "tracker": "mlflow",
                                                "message": "x" * 5000}))
    assert good.tracker_failure == ("mlflow", "x" * progress.MAX_MESSAGE)
    for bad in (None, 3, "", "Not A Name", "x" * 100):
        facts = progress.read(protocol.TrainerEvent("1-0", protocol.TRACKER_FAILED,
                                                    {"type": protocol.TRACKER_FAILED, "tracker": bad}))
        assert facts.tracker_failure is None, bad


def test_each_tracker_is_reported_once_in_the_condition():
    m = tracker_failures.merged(None, "mlflow", "refused")
    assert m == "mlflow failed: refused"
    assert tracker_failures.merged(m, "mlflow", "refused again") is None
    both = tracker_failures.merged(m, "wandb", "bad key")
    assert both == "mlflow failed: refused\nwandb failed: bad key"
    assert tracker_failures.merged(both, "wandb", "") is None


def test_the_operator_sets_one_condition_and_one_event_per_failed_tracker_and_the_job_goes_on():
    st = running_status()
    events = [ev(protocol.TRACKER_FAILED, 1, tracker="mlflow", message="Connection refused"),
              ev(protocol.TRACKER_FAILED, 2, tracker="mlflow", message="Connection refused")]
    d = run(job(st), all_pods(), events=events, now=T0)
    c = cond(d.status, "TrackerFailed")
    assert c.status == "True" and c.reason == "TrackerFailed" and c.message == "mlflow failed: Connection refused"
    assert [(e.type, e.reason) for e in d.events] == [("Warning", "TrackerFailed")]
    assert d.status.phase == "Running" and cond(d.status, "Failed") is None
    d2 = run(job(d.status), all_pods(), now=T0 + timedelta(seconds=5),
             events=[ev(protocol.TRACKER_FAILED, 3, tracker="mlflow", message="other"),
                     ev(protocol.TRACKER_FAILED, 4, tracker="wandb", message="401")])
    assert cond(d2.status, "TrackerFailed").message == "mlflow failed: Connection refused\nwandb failed: 401"
    assert [e.reason for e in d2.events] == ["TrackerFailed"]


def test_tracking_spec_model_refuses_unknown_fields():
    with pytest.raises(ValidationError):
        TrackingSpec.model_validate({"comet": {}})
