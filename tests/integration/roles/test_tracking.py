"""spec.tracking against real trackers: a real `mlflow server` (SQLite store, served artifacts), W&B in offline mode
read back with wandb's own reader of its run files (`wandb leet inspect --json`), TensorBoard event files read back
with tensorboard's EventAccumulator; the trainer role as a real subprocess over a real Redis, restarted from its
checkpoint; and `rlkube local` with a tracker that cannot be reached.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.local_cli import run_local
from support.core_roles import (
    add_documents,
    keys_for,
    make_documents,
    read_events,
    roles_fixture,  # noqa: F401  (fixture roles)
    start_trainer,
    tiny_spec,
    wait_for_event,
)
from support.mlflow_server import MlflowServer

from support import specs
from rlkube.api.tracking import TrackingSpec
from rlkube.contract import protocol, runtime
from rlkube.contract import samples as samples_contract
from rlkube.core.tracking import Trackers, build_trackers
from rlkube.local.ports import free_port

START_TIMEOUT = 90  # python + torch (+ mlflow, wandb) imports on a loaded 2-core machine
WANDB = str(Path(sys.executable).parent / "wandb")
API_KEY = "rlkubeTestKey0123456789abcdefghijklmnopqrstuvwxyz"  # 40+ characters: W&B's format check passes


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


# -- reading back, with each tracker's own code ----------------------------------------------------------------


def mlflow_runs(url: str, experiment: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=url, registry_uri=url)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} on the server"
    return client, client.search_runs([exp.experiment_id])


def wandb_records(directory: Path) -> list[dict]:
    """Every record of every .wandb transaction log under `directory`, as wandb's own reader prints them."""
    files = sorted(directory.rglob("*.wandb"))
    assert files, f"no .wandb run file under {directory}"
    records = []
    for f in files:
        out = subprocess.run([WANDB, "leet", "inspect", "--json", str(f)], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        records += [json.loads(line) for line in out.splitlines() if line.strip()]
    return records


def wandb_history(records: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of `key` in the run's history, `step` being the metric the charts plot against."""
    items = [r["history"]["item"] for r in records if r.get("type") == "history"]
    return [(int(i["step"]), i[key]) for i in items if key in i]


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def numeric(payload: dict) -> dict[str, float]:
    return {k: v for k, v in payload.items() if isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) and k != "step"}


def evaluation(client, keys, version: int, reward: float) -> None:
    """What actor 0 writes after scoring the eval set at `version` (docs/design.md §5.2)."""
    client.xadd(keys.events, protocol.encode_event(
        protocol.EVALUATION, version=version, reward_mean=reward, prompts=8, skipped=0, reward_errors=0,
        model_version=version, model_version_max=version, attempts=1, temperature=0.0, seconds=0.5, actor="actor-0"))


# -- the trainer -------------------------------------------------------------------------------------------------


def test_trainer_logs_steps_evaluations_and_config_and_its_restart_continues_the_run(
        redis_client, redis_server, tmp_path, roles, mlflow_server):
    """Every tracker gets the job's config, every step's metrics and the evaluation results; the trainer stopped
    after step 2 and started again from its checkpoint logs steps 3-4 into the same run: one run per tracker, each
    step once."""
    job = "tracked"
    spec = tiny_spec(maxSteps=4, samplesPerStep=4)
    spec["trainer"]["checkpoint"] = {"intervalSteps": 2}
    spec["evaluation"] = {"everyVersions": 2}
    spec["tracking"] = {"mlflow": {"trackingUri": mlflow_server.url, "experimentName": "restart"},
                        "wandb": {"project": "rlkube-test", "mode": "offline"}, "tensorboard": {}}
    keys = keys_for(job, spec)
    ckpt = tmp_path / "ckpt"
    first = start_trainer(roles, tmp_path, job, spec, redis_server.url)
    add_documents(redis_client, keys, make_documents(8, version=0, seed=1))
    wait_for_event(redis_client, keys, protocol.CHECKPOINT_SAVED, START_TIMEOUT, first, where=lambda e: e.step == 2)
    evaluation(redis_client, keys, 0, 0.125)
    evaluation(redis_client, keys, 2, 0.25)
    first.proc.send_signal(signal.SIGTERM)  # a deleted pod: finish the step, checkpoint, close the trackers
    assert first.wait(60) == 0, first.log()
    stopped = read_events(redis_client, keys, protocol.TRAINING_FINISHED)
    assert [e.payload["interrupted"] for e in stopped] == [True]
    run_file = json.loads((ckpt / "tracking" / "run.json").read_text())

    second = start_trainer(roles, tmp_path, job, spec, redis_server.url)
    wait_for_event(redis_client, keys, protocol.WEIGHTS_READY, START_TIMEOUT, second,
                   where=lambda e: e.payload.get("version") == 2
                   and protocol.stream_id_key(e.stream_id) > protocol.stream_id_key(stopped[0].stream_id))
    add_documents(redis_client, keys, make_documents(8, version=2, seed=2))
    wait_for_event(redis_client, keys, protocol.WEIGHTS_READY, START_TIMEOUT, second,
                   where=lambda e: e.payload.get("version") == 4)
    evaluation(redis_client, keys, 4, 0.5)  # the final version's: the finished trainer waits for it
    wait_for_event(redis_client, keys, protocol.TRAINING_FINISHED, START_TIMEOUT, second,
                   where=lambda e: not e.payload["interrupted"])
    assert second.wait(60) == 0, second.log()
    assert "tracking: mlflow, wandb, tensorboard, run 'tracked' (resumed)" in second.log()
    assert json.loads((ckpt / "tracking" / "run.json").read_text())["ids"] == run_file["ids"]
    assert not read_events(redis_client, keys, protocol.TRACKER_FAILED)

    metrics = read_events(redis_client, keys, protocol.METRICS)
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    logged = {m.step: numeric(m.payload) for m in metrics}
    steps = [1, 2, 3, 4]

    # MLflow: one run, named after the job, finished, each step once, the evaluations at their versions.
    client, runs = mlflow_runs(mlflow_server.url, "restart")
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.run_name == job and run.info.status == "FINISHED" and run.info.run_id == run_file["ids"]["mlflow"]
    for key in ("loss", "reward_mean", "grad_norm", "tokens_per_s"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"train/{key}"))
        assert history == [(s, pytest.approx(logged[s][key])) for s in steps], key
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/reward_mean")) == [
        (0, 0.125), (2, 0.25), (4, 0.5)]
    params = run.data.params
    assert params["job.name"] == job and params["job.namespace"] == "test"
    assert params["spec.algorithm.maxSteps"] == "4" and params["spec.algorithm.samplesPerStep"] == "4"
    assert params["spec.tracking.mlflow.trackingUri"] == mlflow_server.url

    # W&B (offline): two files (one per trainer process) of one run id, each step once, the config.
    records = wandb_records(ckpt / "tracking" / "wandb")
    run_ids = {r["run"]["run_id"] for r in records if r.get("type") == "run"}
    assert run_ids == {run_file["ids"]["wandb"]}
    assert [r["run"]["display_name"] for r in records if r.get("type") == "run"] == [job, job]
    for key in ("loss", "reward_mean", "lag_max"):
        assert wandb_history(records, f"train/{key}") == [(s, pytest.approx(logged[s][key])) for s in steps], key
    assert wandb_history(records, "eval/reward_mean") == [(0, 0.125), (2, 0.25), (4, 0.5)]
    config = {}
    for r in records:
        if r.get("type") == "config":
            config.update(r["config"].get("update", {}))
    assert config["spec.algorithm.maxSteps"] == 4 and config["job.name"] == job

    # TensorBoard: every scalar the trainer logged, at every step, once.
    scalars = tensorboard_scalars(ckpt / "tracking" / "tensorboard")
    expected = {f"train/{k}" for values in logged.values() for k in values}
    assert expected <= set(scalars), sorted(expected - set(scalars))
    for tag in expected:
        key = tag.removeprefix("train/")
        assert scalars[tag] == [(s, pytest.approx(logged[s][key], rel=1e-6, abs=1e-6)) for s in steps
                                if key in logged[s]], tag
    assert [s for s, _ in scalars["eval/reward_mean"]] == [0, 2, 4]


def test_unreachable_tracker_and_refused_key_fail_nothing_and_are_reported_once(
        redis_client, redis_server, tmp_path, roles):
    """MLflow at a port nobody listens on and W&B online with a key its client refuses: training runs to the end,
    each is reported once in a tracker_failed event, TensorBoard still gets every step, and the key is in no event
    and no log line."""
    job = "unreachable"
    spec = tiny_spec(maxSteps=3, samplesPerStep=4)
    spec["tracking"] = {"mlflow": {"trackingUri": f"http://127.0.0.1:{free_port()}"},
                        "wandb": {"project": "p", "mode": "online", "baseUrl": f"http://127.0.0.1:{free_port()}"},
                        "tensorboard": {"directory": "tb/run"}}
    keys = keys_for(job, spec)
    refused = "x" * 12 + API_KEY[:20]  # under 40 characters: W&B refuses it before any request
    trainer = start_trainer(roles, tmp_path, job, spec, redis_server.url, **{runtime.ENV_WANDB_API_KEY: refused})
    add_documents(redis_client, keys, make_documents(12, version=0, seed=3))
    wait_for_event(redis_client, keys, protocol.TRAINING_FINISHED, START_TIMEOUT, trainer)
    assert trainer.wait(60) == 0, trainer.log()

    failed = read_events(redis_client, keys, protocol.TRACKER_FAILED)
    assert sorted(e.payload["tracker"] for e in failed) == ["mlflow", "wandb"], [e.payload for e in failed]
    by_tracker = {e.payload["tracker"]: e.payload["message"] for e in failed}
    assert "API key" in by_tracker["wandb"]
    assert "Connection refused" in by_tracker["mlflow"] or "Max retries" in by_tracker["mlflow"], by_tracker
    assert [m.step for m in read_events(redis_client, keys, protocol.METRICS)] == [1, 2, 3]
    scalars = tensorboard_scalars(tmp_path / "ckpt" / "tracking" / "tb" / "run")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    raw_events = json.dumps([[sid, {k.decode(): v.decode() for k, v in f.items()}]
                             for sid, f in redis_client.xrange(keys.events)], default=str)
    assert refused not in raw_events and refused not in trainer.log()


# -- the fan-out's tables --------------------------------------------------------------------------------------


def test_log_table_reaches_mlflow_and_wandb_and_is_safe_without_trackers(tmp_path, mlflow_server, monkeypatch):
    rows = [{"prompt": "12+7", "completion": "19", "reward": 1.0, "turns": [{"role": "tool", "content": "19"}]},
            {"prompt": "3*4", "completion": "13", "reward": 0.0, "turns": []}]
    Trackers.none().log_table("samples", rows, step=3)  # no tracker configured: nothing happens, nothing fails
    Trackers.none().close()

    spec = TrackingSpec.model_validate({"mlflow": {"trackingUri": mlflow_server.url, "experimentName": "tables"},
                                        "wandb": {"project": "p", "mode": "offline"}, "tensorboard": {}})
    trackers = build_trackers(spec, "ns", "tables-job", tmp_path / "tracking", env={})
    trackers.log_table("samples", rows, step=3)
    trackers.log_table("samples", rows[:1], step=6)
    trackers.close()
    assert trackers.take_failures() == []

    client, runs = mlflow_runs(mlflow_server.url, "tables")
    (run,) = runs
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)  # load_table searches through the fluent API
    table = client.load_table(run.info.experiment_id, "samples.json", run_ids=[run.info.run_id])
    assert list(table["prompt"]) == ["12+7", "3*4", "12+7"] and list(table["step"]) == [3, 3, 6]
    assert list(table["reward"]) == [1.0, 0.0, 1.0]
    assert json.loads(table["turns"][0]) == [{"role": "tool", "content": "19"}]

    records = wandb_records(tmp_path / "tracking" / "wandb")
    items = [r["history"]["item"] for r in records if r.get("type") == "history"]
    tables = [i for i in items if i.get("samples._type") == "table-file"]
    assert [(t["step"], t["samples.nrows"]) for t in tables] == [(3, 2), (6, 1)]
    (run_dir,) = (tmp_path / "tracking" / "wandb" / "wandb").glob("offline-run-*")
    first = json.loads((run_dir / "files" / tables[0]["samples.path"]).read_text())
    assert first["columns"] == ["completion", "prompt", "reward", "turns"]
    assert first["data"][0][:3] == ["19", "12+7", 1.0] and json.loads(first["data"][0][3])[0]["content"] == "19"


# -- rlkube local ------------------------------------------------------------------------------------------------


def test_rlkube_local_with_an_unreachable_tracker_succeeds_with_one_condition(tmp_path):
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"
    doc = specs.document(**{"spec.algorithm.maxSteps": 4, "spec.tracking": {"mlflow": {"trackingUri": uri},
                                                                           "tensorboard": {}}})
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary, stderr = run_local(manifest, out, timeout=600)
    assert summary["phase"] == "Succeeded" and summary["steps"] == 4, summary
    (condition,) = summary["conditions"]
    assert condition["type"] == "TrackerFailed" and condition["status"] == "True"
    assert condition["message"].startswith("mlflow failed: ") and len(condition["message"].splitlines()) == 1
    assert stderr.count("mlflow failed: ") == 1
    scalars = tensorboard_scalars(out / "checkpoints" / "tracking" / "tensorboard")
    assert [s for s, _ in scalars["train/reward_mean"]] == [1, 2, 3, 4]


def test_rlkube_local_tiny_job_reaches_a_real_mlflow_server_with_its_evaluations(tmp_path, mlflow_server,
                                                                                monkeypatch):
    """The whole tiny job (actors sampling, actor 0 evaluating every 2 versions): its run on the MLflow server holds
    every step's metrics, the evaluations the actor reported, the job's config, and the sample tables: the same rows
    as samples.jsonl, the final version's evaluation included."""
    out = tmp_path / "run"
    doc = specs.document(**{"metadata.name": "tiny-mlflow", "spec.algorithm.maxSteps": 4,
                            "spec.evaluation": {"everyVersions": 2, "prompts": 4},
                            "spec.samples": {"everySteps": 2, "perStep": 2},
                            "spec.tracking": {"mlflow": {"trackingUri": mlflow_server.url,
                                                         "experimentName": "local"}}})
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    summary, _ = run_local(manifest, out, timeout=600)
    assert summary["phase"] == "Succeeded" and summary["conditions"] == [], summary
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evaluations = [json.loads(line) for line in (out / "evaluation.jsonl").read_text().splitlines()]

    client, runs = mlflow_runs(mlflow_server.url, "local")
    (run,) = runs
    assert run.info.run_name == "tiny-mlflow" and run.info.status == "FINISHED"
    rewards = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/reward_mean"))
    assert rewards == [(m["step"], pytest.approx(m["reward_mean"])) for m in metrics]
    assert [s for s, _ in rewards] == [1, 2, 3, 4]
    evals = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/reward_mean"))
    assert evals == sorted((e["version"], pytest.approx(e["reward_mean"])) for e in evaluations)

    kept = list(samples_contract.read_rows(out / samples_contract.FILE))
    train = [r for r in kept if r["kind"] == samples_contract.TRAIN]
    evaluated = [r for r in kept if r["kind"] == samples_contract.EVALUATION]
    assert [r["step"] for r in train] == [2, 2, 4, 4]
    assert sorted({r["version"] for r in evaluated}) == [0, 2, 4] == sorted(e["version"] for e in evaluations)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)  # load_table searches through the fluent API
    for name, rows in (("samples", train), ("evaluation_samples", evaluated)):
        table = client.load_table(run.info.experiment_id, f"{name}.json", run_ids=[run.info.run_id])
        assert list(zip(table["step"], table["prompt"], strict=True)) == [(r["step"], r["prompt"]) for r in rows]
    assert [v for v, _ in evals][-1] == 4  # the final version's evaluation too: the trainer waited for it
    assert run.data.params["spec.evaluation.everyVersions"] == "2"
