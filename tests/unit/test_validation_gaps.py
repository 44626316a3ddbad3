"""Manifests a user writes that cannot run as written, refused alike by `rlkube validate`, the admission webhook and
the operator (status Failed/InvalidSpec, a Warning Event, nothing created), naming the fields, and reporting only
the true error (docs/guide/validation-and-security.md):
- an environment name that is no built-in (the list is closed: calculator, verifiers);
- two prompt sources: a built-in environment draws its own prompts, so a reasoning-gym task or a dataset beside it
  would be ignored;
- reasoning-gym's config.seed / config.size, which rlkube sets itself;
- an sft job without completionField is told that, and not also that it needs a reward (sft scores nothing).
An environment entryPoint is checked for importability only where the roles' packages are known (`rlkube validate`
on the project's images, `rlkube local`); elsewhere the actor imports it at start (tests/integration/
test_local_episodes.py shows the exit 78 naming the field).
The real API server's part (the CRD's enum, the webhook served for real):
tests/integration/apiserver/test_chart_apply.py and tests/integration/apiserver/test_operator_children.py.
"""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime

import pytest
from support import specs
import yaml
from rlkube.api.status import TrainingJobStatus
from rlkube.controller.process import admission
from rlkube.controller.decisions.actions import Create
from rlkube.controller.decisions.recipe import decide
from rlkube.controller.reconcile.job_io import job_view
from rlkube.controller.decisions.observed import EventSource, Observed

CALCULATOR = {"name": "calculator"}
DATASET = {"path": "/data/prompts.jsonl"}

GAPS = {
    "environment name no built-in": (
        {"spec.task.environment": {"name": "calculater"}},
        {"spec.task.environment.name": "Input should be 'calculator' or 'verifiers'"}),
    "environment and reasoningGym": (
        {"spec.task.environment": CALCULATOR, "spec.task.reasoningGym": {"name": "basic_arithmetic"}},
        {"spec.task.reasoningGym": "not with spec.task.environment.name 'calculator', which draws its own prompts"}),
    "environment and dataset": (
        {"spec.task.environment": CALCULATOR, "spec.task.dataset": DATASET, "spec.task.reward": {"type": "exact"}},
        {"spec.task.dataset": "not with spec.task.environment.name 'calculator', which draws its own prompts"}),
    "reasoningGym reserved config": (
        {"spec.task.reasoningGym": {"name": "basic_arithmetic", "config": {"seed": 3, "size": 5, "max_terms": 3}}},
        {"spec.task.reasoningGym.config.seed": "reserved: rlkube sets the generator's seed from "
                                               "spec.task.reasoningGym.seed",
         "spec.task.reasoningGym.config.size": "reserved: rlkube sets the generator's size from "
                                               "spec.task.reasoningGym.size"}),
    "sft without completionField": (
        {"spec.algorithm.loss": "sft", "spec.task.dataset": DATASET},
        {"spec.task.dataset.completionField": "required with spec.algorithm.loss sft"}),
}
"""Each gap: the manifest's overrides of examples/tiny-cpu.yaml, and every error it must get (field: message start),
no other."""

ALLOWED = {
    "a built-in environment alone": {"spec.task.environment": CALCULATOR},
    "an sft dataset with its completionField": {"spec.algorithm.loss": "sft",
                                                "spec.task.dataset": {**DATASET, "completionField": "completion"}},
    "a reasoningGym task with its own seed and size": {"spec.task.reasoningGym": {
        "name": "basic_arithmetic", "seed": 3, "size": 5, "config": {"max_terms": 3}}},
}


def _fields(message: str) -> dict[str, str]:
    """`field: message; field: message` (SpecError's form) as a mapping."""
    return dict(part.split(": ", 1) for part in message.split("; "))


def _only(reported: dict[str, str], expected: dict[str, str]) -> None:
    assert set(reported) == set(expected), reported
    for field, start in expected.items():
        assert reported[field].startswith(start), (field, reported[field])


def _validate(tmp_path, doc: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run([sys.executable, "-m", "rlkube.cli", "validate", str(path)], capture_output=True, text=True)


def _stderr_fields(path_prefix: str, stderr: str) -> dict[str, str]:
    lines = [line.removeprefix(path_prefix) for line in stderr.splitlines() if line.startswith(path_prefix)]
    return dict(line.split(": ", 1) for line in lines)


@pytest.mark.parametrize("case", list(GAPS))
def test_rlkube_validate_refuses_naming_only_the_true_fields(case, tmp_path):
    overrides, expected = GAPS[case]
    out = _validate(tmp_path, specs.document(**overrides))
    assert out.returncode == 1 and "valid" not in out.stdout, (out.stdout, out.stderr)
    _only(_stderr_fields(f"{tmp_path / 'job.yaml'}: ", out.stderr), expected)


def _review(doc: dict) -> dict:
    return admission.review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                             "request": {"uid": "u", "operation": "CREATE", "namespace": "ns", "object": doc}})[
        "response"]


@pytest.mark.parametrize("case", list(GAPS))
def test_the_webhook_refuses_naming_only_the_true_fields(case):
    overrides, expected = GAPS[case]
    response = _review(specs.document(**overrides))
    assert response["allowed"] is False and response["status"]["code"] == 422, response
    message = response["status"]["message"]
    assert message.startswith("TrainingJob tiny-cpu: "), message
    _only(_fields(message.removeprefix("TrainingJob tiny-cpu: ")), expected)


T0 = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)


def _operator_pass(doc: dict):
    """One reconcile pass of the operator over a new job stored with this manifest (job_io.job_view parses it as the
    operator does), nothing of it existing yet."""
    body = {**doc, "metadata": {**doc["metadata"], "namespace": "ns", "uid": "uid-1", "generation": 1}}
    view = job_view(body, TrainingJobStatus())
    return decide(view, Observed(event_source=EventSource()), T0)


@pytest.mark.parametrize("case", list(GAPS))
def test_the_operator_fails_the_job_naming_only_the_true_fields_and_creates_nothing(case):
    overrides, expected = GAPS[case]
    d = _operator_pass(specs.document(**overrides))
    assert (d.status.phase, d.status.reason) == ("Failed", "InvalidSpec"), d.status
    assert not [a for a in d.actions if isinstance(a, Create)], d.actions
    _only(_fields(d.status.message), expected)
    warnings = [e for e in d.events if e.type == "Warning" and e.reason == "InvalidSpec"]
    assert len(warnings) == 1, d.events
    # The Event says which condition it reports, then the same message.
    assert warnings[0].message == f"Failed=True: {d.status.message}", warnings[0].message


@pytest.mark.parametrize("case", list(ALLOWED))
def test_the_same_fields_used_as_meant_pass_all_three(case, tmp_path):
    doc = specs.document(**ALLOWED[case])
    out = _validate(tmp_path, doc)
    assert out.returncode == 0 and "tiny-cpu: valid" in out.stdout, out.stderr
    assert _review(doc)["allowed"] is True
    d = _operator_pass(doc)
    assert d.status.reason != "InvalidSpec" and [a for a in d.actions if isinstance(a, Create)], d.status


# -- an environment entryPoint: importable where the roles' packages are known --------------------------------

@pytest.mark.parametrize("entry_point, says", [
    ("no_such_package.envs:make", "cannot import 'no_such_package.envs': no module 'no_such_package' here"),
    ("rlkube.core.actor.calculator:no_such_factory", "module 'rlkube.core.actor.calculator' has no attribute "
                                                     "'no_such_factory'"),
])
def test_an_entry_point_the_projects_image_cannot_import_is_refused_by_rlkube_validate(entry_point, says, tmp_path):
    doc = specs.document(**{"spec.task.environment": {"entryPoint": entry_point}})
    assert doc["spec"]["image"].startswith("ghcr.io/rlkube/"), doc["spec"]["image"]
    out = _validate(tmp_path, doc)
    assert out.returncode == 1, out.stdout
    _only(_stderr_fields(f"{tmp_path / 'job.yaml'}: ", out.stderr), {"spec.task.environment.entryPoint": says})
    # A user's image may hold the package: validate cannot know, and passes it to the actor's check at start.
    theirs = specs.with_overrides(doc, {"spec.image": "registry.example.com/team/rl-envs:1"})
    out = _validate(tmp_path, theirs)
    assert out.returncode == 0 and "tiny-cpu: valid" in out.stdout, out.stderr
    # Nor can the webhook or the operator, whose interpreter is not the actors'.
    assert _review(doc)["allowed"] is True
    assert _operator_pass(doc).status.reason != "InvalidSpec"


def test_an_importable_entry_point_passes_rlkube_validate(tmp_path):
    doc = specs.document(**{"spec.task.environment": {"entryPoint": "rlkube.core.actor.calculator:factory"}})
    out = _validate(tmp_path, doc)
    assert out.returncode == 0 and "tiny-cpu: valid" in out.stdout, out.stderr


def test_the_built_in_environment_names_are_the_actors():
    """The CRD's enum (api.task.BuiltinEnvironment) is the list the actor builds from."""
    from typing import get_args

    from rlkube.api.task import BuiltinEnvironment
    from rlkube.core.actor.environments import BUILTIN_ENVIRONMENTS

    assert set(get_args(BuiltinEnvironment)) == set(BUILTIN_ENVIRONMENTS)


def test_rlkube_local_refuses_an_entry_point_its_interpreter_cannot_import_before_starting_anything(tmp_path):
    """`rlkube local` runs the roles in this interpreter: what it cannot import fails the run InvalidSpec, naming the
    field, before any process or output directory exists (whatever the image says)."""
    from rich.console import Console

    from rlkube.local.runner import run_local

    doc = specs.document(**{"spec.image": "registry.example.com/team/rl-envs:1",
                            "spec.task.environment": {"entryPoint": "no_such_package.envs:make"}})
    result = run_local(doc, tmp_path / "run", Console(quiet=True), model_cache=tmp_path / "cache")
    assert (result.phase, result.reason) == ("Failed", "InvalidSpec"), result
    assert result.invalid == ["spec.task.environment.entryPoint: cannot import 'no_such_package.envs': no module "
                              "'no_such_package' here"], result.invalid
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
