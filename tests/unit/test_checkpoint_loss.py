"""The checkpoint-loss rule (rlkube.contract.checkpoint_loss): a restarted trainer that finds no checkpoint, or an
older one, where its launcher saw one saved fails the job at once (CheckpointLost, naming
spec.trainer.checkpoint.claimName) instead of silently starting over; how the expectation reaches the trainer from
the operator's pod and from `rlkube local`'s env; the warning a job on an emptyDir gets."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from rlkube.lifecycle.validation import parse_spec
from rlkube.controller.manifests import builders, names
from rlkube.contract import runtime
from rlkube.core.training.checkpoint import checkpoint_name
from rlkube.contract import checkpoint_loss
from rlkube.lifecycle.environment import Addresses, operator_env_names, role_env
from rlkube.lifecycle.evidence import Evidence, Failure
from rlkube.lifecycle.judgement import judge

EXAMPLE = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml").read_text())
SAVED = f"/checkpoints/{checkpoint_name(10)}"
FIELD = "spec.trainer.checkpoint.claimName"


def spec(**overrides):
    raw = yaml.safe_load(yaml.safe_dump(EXAMPLE["spec"]))
    for path, value in overrides.items():
        node = raw
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return parse_spec(raw)


def test_the_step_is_read_from_the_checkpoint_name_the_trainer_writes():
    assert checkpoint_loss.step_of(SAVED) == 10
    assert checkpoint_loss.step_of(checkpoint_name(1234567)) == 1234567
    assert checkpoint_loss.step_of("/ckpt/fast-llm/checkpoint/7") == 7  # Fast-LLM's layout (its launcher checks it)
    assert checkpoint_loss.step_of("/ckpt/checkpoint/latest") is None


@pytest.mark.parametrize("expected, resumed, lost", [
    (None, None, False),        # nothing saved yet: a first start, or a restart before the first checkpoint
    ("", None, False),
    (SAVED, 10, False),         # found it (a claim, or a container restarted in place on its emptyDir)
    (SAVED, 15, False),         # newer: saved after the launcher last looked
    (SAVED, None, True),        # the volume is empty: an emptyDir recreated with the pod
    (SAVED, 5, True),           # older than what was saved
    ("/elsewhere/latest", 3, False),  # an unknown name: any checkpoint will do
    ("/elsewhere/latest", None, True),
])
def test_a_trainer_may_go_on_only_from_at_least_the_saved_checkpoint(expected, resumed, lost):
    message = checkpoint_loss.loss(expected, resumed, "/checkpoints")
    assert (message is not None) == lost
    if lost:
        assert expected in message and FIELD in message and "emptyDir" in message
        assert checkpoint_loss.is_loss(f"{FIELD}: {message}")


def test_the_message_names_the_path_step_what_was_found_and_the_field():
    assert checkpoint_loss.loss(SAVED, None, "/checkpoints") == (
        f"checkpoint lost: the checkpoint at {SAVED} step 10 is gone (/checkpoints holds no checkpoint): the "
        "checkpoint volume was likely an emptyDir, lost with the trainer pod; the trainer will not silently start "
        f"over. Set {FIELD} to a PersistentVolumeClaim so a recreated trainer pod resumes")
    assert "(/checkpoints holds only step 5)" in checkpoint_loss.loss(SAVED, 5, "/checkpoints")


def test_the_judgement_fails_the_job_at_once_with_checkpoint_lost():
    text = f"{FIELD}: {checkpoint_loss.loss(SAVED, None, '/checkpoints')}"
    # As the launcher reports a failed rank (rlkube.core.launch.ranks): prefixed, still recognised.
    for message in (text, f"trainer rank 0 (node 0, local rank 0) exited 78: {text}"):
        failure = Failure("trainer", "tj-trainer-0", runtime.EXIT_CONFIG, message)
        ev = Evidence(now=datetime(2025, 1, 1, tzinfo=UTC), config_error=failure, restarts={"trainer": 1})
        o = judge(ev, spec()).outcome
        assert (o.phase, o.reason) == ("Failed", "CheckpointLost") and FIELD in o.message and SAVED in o.message
    other = Failure("actor", "tj-actor-0", runtime.EXIT_CONFIG, "spec.task.dataset.promptField: no column")
    o = judge(Evidence(now=datetime(2025, 1, 1, tzinfo=UTC), config_error=other), spec()).outcome
    assert o.reason == "InvalidSpec"


def test_the_trainer_raises_a_config_error_naming_the_field():
    from rlkube.core.errors import ConfigError
    from rlkube.core.trainer import require_expected_checkpoint

    env = {runtime.ENV_RESUME_CHECKPOINT: SAVED}
    empty = SimpleNamespace(last_checkpoint=None, checkpoint_dir=Path("/checkpoints"))
    with pytest.raises(ConfigError) as err:
        require_expected_checkpoint(empty, env)
    assert err.value.field == FIELD and str(err.value).startswith(f"{FIELD}: checkpoint lost: ")
    require_expected_checkpoint(empty, {})  # nothing was saved: a fresh start
    require_expected_checkpoint(SimpleNamespace(last_checkpoint=(10, Path(SAVED)), checkpoint_dir="/c"), env)
    with pytest.raises(ConfigError):
        require_expected_checkpoint(SimpleNamespace(last_checkpoint=(5, Path("/c/x")), checkpoint_dir="/c"), env)


def test_the_operator_passes_the_resume_annotation_to_the_trainer_process_only():
    job = builders.JobRef("ns", "tj", "uid-1", spec(), EXAMPLE["spec"])
    trainer = builders.pod(job, "trainer", 0, resume_checkpoint=SAVED)
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    assert trainer["metadata"]["annotations"][names.ANNOTATION_RESUME] == SAVED == env[runtime.ENV_RESUME_CHECKPOINT]
    first = builders.pod(job, "trainer", 0)
    assert runtime.ENV_RESUME_CHECKPOINT not in {e["name"] for e in first["spec"]["containers"][0]["env"]}
    for role in ("inference", "actor", "preprocessor"):
        pod = builders.pod(job, role, 0, resume_checkpoint=SAVED)
        assert runtime.ENV_RESUME_CHECKPOINT not in {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    # Set by the operator: a pod template may not override it.
    assert runtime.ENV_RESUME_CHECKPOINT in operator_env_names(spec(), "trainer")


def test_rlkube_local_gets_the_same_variable_from_the_same_function():
    at = Addresses(config_path="c", redis_url="redis://x", bind_host="127.0.0.1", inference_urls=("u",),
                   inference_ports=(1,), weight_sync_host="127.0.0.1", weight_sync_port=2, master_port=3,
                   checkpoint_dir="/out/checkpoints")
    assert dict(role_env(spec(), "trainer", 0, at, SAVED))[runtime.ENV_RESUME_CHECKPOINT] == SAVED
    assert runtime.ENV_RESUME_CHECKPOINT not in dict(role_env(spec(), "trainer", 0, at))


@pytest.mark.parametrize("overrides, warned", [
    ({}, True),  # the example: emptyDir, backoffLimit 2
    ({"trainer.checkpoint.claimName": "ckpt"}, False),
    ({"runPolicy.backoffLimit": 0}, False),  # no restart: nothing to resume
])
def test_the_creation_warning_is_for_an_empty_dir_with_restarts_allowed(overrides, warned):
    message = checkpoint_loss.ephemeral_warning(spec(**overrides))
    assert (message is not None) == warned
    if warned:
        assert FIELD in message and "emptyDir" in message and "backoffLimit 2" in message
