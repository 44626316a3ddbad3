"""What rlkube supplies around a Fast-LLM trainer that Fast-LLM does not: timeouts from the spec on both sides of
its broadcast and on its documents, the checkpoint-loss rule over Fast-LLM's checkpoints, and a clear failure for
an image without Fast-LLM (rlkube.core.launch.fast_llm, rlkube.controller.manifests.fastllm; docs/design.md §8)."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path

import pytest

from rlkube.contract import checkpoint_loss, fast_llm_rendezvous, protocol, runtime
from rlkube.controller.manifests import fastllm
from rlkube.core.launch import fast_llm as fast_llm_launch
from rlkube.lifecycle.evidence import Evidence, Failure
from rlkube.lifecycle.judgement import judge
from rlkube.lifecycle.validation import SpecError, parse_spec
from rlkube.local.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests" / "fixtures" / "fast_llm_config_fields.json").read_text())
EXAMPLE = FIXTURE["samples"]["examples/fast-llm.yaml"]["spec"]


def spec(**fast_llm):
    raw = copy.deepcopy(EXAMPLE)
    raw["trainer"].setdefault("fastLlm", {}).update(fast_llm)
    return parse_spec(raw)


# --- timeouts ----------------------------------------------------------------------------------------------


def test_fast_llms_600_s_default_is_replaced_by_the_spec_on_both_sides():
    fast_llm_default = FIXTURE["document"]["evidence"]["redis_timeout_default"]["source"]
    assert "default=600.0" in fast_llm_default
    s = spec()
    config = fastllm.training_config(s, "ns", "j")
    data, broadcast = config["data"]["datasets"]["training"]["timeout"], config["callbacks"]["streaming"]["timeout"]
    # Defaults that outlast Fast-LLM's 600 s; the servers (receivers) wait in the broadcast longer than the trainer
    # waits for documents, and they use the broadcast's value: the same on both sides.
    assert 600 < data < broadcast == fast_llm_rendezvous.broadcast_timeout_s(s) == fast_llm_rendezvous.RECEIVER_TIMEOUT_S
    s = spec(dataTimeoutSeconds=5400, broadcastTimeoutSeconds=9000)
    config = fastllm.training_config(s, "ns", "j")
    assert config["data"]["datasets"]["training"]["timeout"] == 5400
    assert config["callbacks"]["streaming"]["timeout"] == 9000 == fast_llm_rendezvous.broadcast_timeout_s(s)


def test_a_broadcast_timeout_the_data_wait_would_outlast_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"spec\.trainer\.fastLlm\.broadcastTimeoutSeconds: must exceed "
                                        r"dataTimeoutSeconds \(3600\)"):
        spec(broadcastTimeoutSeconds=3600)


def test_the_vllm_engine_joins_with_the_spec_value():
    """The receivers' side: the group the vLLM engine's workers join takes the spec's broadcast timeout."""
    from rlkube.contract.context import RoleContext
    from rlkube.core.inference.vllm_engine import weight_group

    ctx = RoleContext(namespace="ns", job="j", spec=spec(broadcastTimeoutSeconds=9000), redis_url="redis://unused",
                      weight_sync_addr="127.0.0.1:29500")
    group = weight_group(ctx)
    assert group.fast_llm_timeout_s == 9000 and group.fast_llm_backend is not None


# --- checkpoint loss ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("announced", "interval", "saved"), [
    (None, 10, None), (1, 10, None), (10, 10, None),  # step 10's checkpoint follows its weights_ready
    (11, 10, 10), (25, 10, 20), (7, 1, 6)])
def test_the_checkpoint_an_announced_step_proves(announced, interval, saved):
    assert checkpoint_loss.fast_llm_saved(announced, interval) == saved


def test_fast_llms_checkpoint_path_is_read_back_as_its_step():
    assert checkpoint_loss.step_of(checkpoint_loss.fast_llm_checkpoint("/checkpoints/", 20)) == 20
    assert checkpoint_loss.fast_llm_checkpoint("/checkpoints", 20) == "/checkpoints/checkpoint/20"


def _checkpoints(root: Path, *steps: int) -> str:
    for step in steps:
        (root / "checkpoint" / str(step)).mkdir(parents=True)
    return str(root)


def test_a_recreated_fast_llm_trainer_on_an_empty_volume_fails_the_job_with_checkpoint_lost(tmp_path):
    """It announced step 25 (checkpoints every 10), so step 20's checkpoint was saved; an empty volume (an
    emptyDir that went with the pod) would start Fast-LLM over at step 0."""
    empty = _checkpoints(tmp_path / "empty")
    message = fast_llm_launch.checkpoint_loss_message(empty, 10, announced=25)
    assert message is not None and "/checkpoint/20 step 20 is gone" in message and "no checkpoint" in message
    error = f"{checkpoint_loss.FIELD}: {message}"
    assert checkpoint_loss.is_loss(error)
    ev = Evidence(now=None, config_error=Failure("trainer", "j-trainer-0", runtime.EXIT_CONFIG, error))
    assert judge(ev, spec()).outcome.reason == "CheckpointLost"
    # an older checkpoint only is a loss too; the proven one or a newer one, or nothing announced yet, is not
    assert "only step 10" in fast_llm_launch.checkpoint_loss_message(_checkpoints(tmp_path / "old", 10), 10, 25)
    assert fast_llm_launch.checkpoint_loss_message(_checkpoints(tmp_path / "ok", 10, 20), 10, 25) is None
    assert fast_llm_launch.checkpoint_loss_message(empty, 10, announced=None) is None
    assert fast_llm_launch.checkpoint_loss_message(empty, 10, announced=9) is None


def test_the_launcher_reads_the_newest_announced_step_of_every_incarnation(redis_server, redis_client):
    stream = protocol.EVENTS_STREAM
    for step in (0, 1, 2, 3, 1, 2):  # a restart from step 1's checkpoint
        redis_client.xadd(stream, protocol.encode_event(protocol.WEIGHTS_READY, step=step, documents_seen=8 * step))
    redis_client.xadd(stream, {"event": b"not json"})
    assert fast_llm_launch.announced_step(redis_client, stream) == 3
    assert fast_llm_launch.announced_step(redis_client, "no-such-stream") is None


def test_node_0s_launcher_is_told_where_fast_llm_checkpoints():
    s = spec()
    cmd = fastllm.pod_command(s, "j", 0, 29400, image="ghcr.io/x/trainer-fast-llm:1")
    launcher = cmd[:cmd.index("--")]
    flag = {launcher[i]: launcher[i + 1] for i in range(len(launcher) - 1) if launcher[i].startswith("--")}
    assert flag["--checkpoint-dir"] == s.trainer.checkpoint.path == fastllm.training_config(s, "ns", "j")["run"][
        "experiment_dir"]
    assert flag["--checkpoint-interval"] == str(s.trainer.checkpoint.interval_steps)
    assert flag["--events-stream"] == protocol.EVENTS_STREAM and flag["--image"] == "ghcr.io/x/trainer-fast-llm:1"
    assert "--checkpoint-dir" not in fastllm.pod_command(s, "j", 1, 29400)


def test_the_creation_warning_no_longer_says_fast_llm_starts_over():
    warning = checkpoint_loss.ephemeral_warning(spec())
    assert warning is not None and "starts at step 0" not in warning and "fails the job" in warning


# --- missing command --------------------------------------------------------------------------------------------


def _bin(tmp_path: Path, *names: str) -> str:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name in names:
        (d / name).write_text("#!/bin/sh\nexit 0\n")
        (d / name).chmod(stat.S_IRWXU)
    return str(d)


def _launch(tmp_path: Path, path: str, monkeypatch) -> tuple[int, str]:
    s = spec()
    cmd = fastllm.pod_command(s, "j", 1, 29400, image="ghcr.io/x/core:1")  # node 1: no Redis or checkpoint check
    message = tmp_path / "termination-log"
    monkeypatch.setenv(runtime.ENV_TERMINATION_LOG, str(message))
    env = {"PATH": path}
    cmd[cmd.index("--redis-listen") + 1] = f"127.0.0.1:{free_port()}"  # not the pod's port: a test's Redis may hold it
    code = fast_llm_launch.run(cmd[cmd.index("-m") + 2:], env=env)
    return code, message.read_text() if message.exists() else ""


def test_an_image_without_fast_llm_fails_the_job_at_once_naming_the_image_and_the_command(tmp_path, monkeypatch):
    code, message = _launch(tmp_path, _bin(tmp_path, "torchrun"), monkeypatch)  # torch, but no Fast-LLM
    assert code == runtime.EXIT_CONFIG
    assert message.startswith("spec.trainer.image: image ghcr.io/x/core:1 has no `fast-llm` command on its PATH")
    ev = Evidence(now=None, config_error=Failure("trainer", "j-trainer-1", code, message))
    verdict = judge(ev, spec())
    assert verdict.outcome.reason == "InvalidSpec" and "ghcr.io/x/core:1" in verdict.outcome.message


def test_with_both_commands_the_launcher_runs_torchrun(tmp_path, monkeypatch):
    code, message = _launch(tmp_path, _bin(tmp_path, "torchrun", "fast-llm"), monkeypatch)
    assert (code, message) == (0, "")
    assert fast_llm_launch.programs(["torchrun", "--nnodes=1", "--no-python", "fast-llm", "train"]) == [
        "torchrun", "fast-llm"]
