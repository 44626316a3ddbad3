"""`rlkube local` materializes spec.model.path before launch: a model that cannot work is judged like a role's
config error (the operator's verdict) with nothing started, and every role is pointed at the materialized copy
(RLKUBE_MODEL_CACHE) offline. The same jobs run end to end in tests/integration/local/test_local_hf_models.py."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from rich.console import Console
from rlkube.lifecycle.validation import parse_spec
from rlkube.contract import runtime
from rlkube.core.hf.source import builtin_dir
from rlkube.lifecycle import roles
from rlkube.lifecycle.environment import Addresses
from rlkube.lifecycle.evidence import Evidence, Failure
from rlkube.lifecycle.judgement import judge
from rlkube.local.runner import MODEL_FETCH, LocalJob, run_local
from support import specs

EXAMPLE = specs.document()


def manifest(path: str) -> dict:
    return specs.document(**{"spec.model.path": path})


@pytest.mark.parametrize(("path", "says"), [
    ("/nonexistent/model", "/nonexistent/model does not exist"),
    ("hf://acme/nowhere", "hf://acme/nowhere: HF_HUB_OFFLINE is set and no complete snapshot"),
])
def test_a_model_that_cannot_work_fails_the_job_as_the_operator_judges_a_config_error(tmp_path, monkeypatch,
                                                                                       path, says):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run_local(manifest(path), tmp_path / "run", Console(quiet=True), model_cache=tmp_path / "cache")
    assert (result.phase, result.reason) == ("Failed", "InvalidSpec")
    assert says in result.message and "spec.model.path: " in result.message
    # The verdict the lifecycle gives any launcher for a process that exited EXIT_CONFIG with that message.
    message = result.message.split(" cannot run: ", 1)[1]
    expected = judge(Evidence(now=datetime.now(timezone.utc), config_error=Failure(*MODEL_FETCH, runtime.EXIT_CONFIG, message)),
                     parse_spec(manifest(path)["spec"])).outcome
    assert (result.phase, result.reason, result.message) == (expected.phase, expected.reason, expected.message)
    assert result.teardown == [] and result.steps == 0 and not result.invalid
    assert not (tmp_path / "run").exists()


def test_a_builtin_model_is_written_into_the_given_cache_before_launch(tmp_path):
    from rlkube.local.runner import materialize

    spec = parse_spec(manifest("builtin://tiny-llama")["spec"])
    assert materialize(spec, tmp_path / "cache", Console(quiet=True)) is None
    assert (builtin_dir("tiny-llama", spec.model.seed, tmp_path / "cache") / "config.json").is_file()


def test_every_role_gets_the_model_cache_and_runs_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv(runtime.ENV_MODEL_CACHE, "/somewhere/else")  # the runner's choice wins
    spec = parse_spec(EXAMPLE["spec"])
    job = LocalJob("j", spec, EXAMPLE["spec"], tmp_path, Console(quiet=True), model_cache=tmp_path / "cache")
    job.addresses = Addresses(
        config_path=str(tmp_path / "job.json"), redis_url="redis://127.0.0.1:1/0", bind_host="127.0.0.1",
        inference_urls=("http://127.0.0.1:2",), inference_ports=(2,), weight_sync_host="127.0.0.1",
        weight_sync_port=3, master_port=4, checkpoint_dir=str(tmp_path / "ckpt"), output_dir=str(tmp_path),
    )
    for role in roles.CORE_ROLES:
        env = job._env(role, 0)
        assert env[runtime.ENV_MODEL_CACHE] == str(tmp_path / "cache") and env["HF_HUB_OFFLINE"] == "1", role

