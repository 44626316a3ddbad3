"""The actor role as real processes against a real native inference server, real Redis and a trainer stand-in.

Covered: the lag bound (holds at exactly (maxLag+1) x samplesPerStep samples ahead of the trainer, shared by two
replicas, resumes on weights_ready), the rebase after a trainer restart, stopping on training_finished and never
on counts, SIGTERM -> exit 0, an inference server that dies and comes back is retried, not fatal, prompts from a
JSONL dataset with a reward function that raises (scored 0, counted, the actor goes on), and a dataset that lacks
the mapped column stopping the actor at start with the spec field in its message.
"""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from rlkube.contract import protocol, runtime
from rlkube.core.actor.lag import LagKeys
from support.serve_helpers import (
    PREFIX,
    RoleProcesses,
    free_port,
    http_status,
    job_spec,
    log_text,
    publish,
    wait_for,
    write_config,
)

KEYS = protocol.StreamKeys(PREFIX)
LAG = LagKeys.for_job(KEYS)


def make_roles(tmp_path, redis_server, task=None, **algorithm) -> RoleProcesses:
    spec = job_spec(**algorithm)
    if task is not None:
        spec["task"] = task
    return RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))


@pytest.fixture
def stack(tmp_path, redis_server, redis_client):
    """Factory: inference server + trainer stand-in (version 0 announced and transferred) for a given algorithm."""
    made: list[RoleProcesses] = []

    def start(task=None, **algorithm):
        roles = make_roles(tmp_path, redis_server, task, **algorithm)
        made.append(roles)
        port = free_port()
        server = roles.start_role("inference", RLKUBE_PORT=str(port))
        url = f"http://127.0.0.1:{port}"
        trainer = roles.start_trainer(0)
        wait_for(lambda: http_status(url + "/health") == 200 or server.poll() is not None, 60, "inference health")
        assert server.poll() is None, log_text(server)
        return roles, url, server, trainer, port

    yield start
    for roles in made:
        roles.cleanup()


def start_actor(roles: RoleProcesses, url: str, index: int = 0, **env: str):
    return roles.start_role("actor", name=f"actor{index}", RLKUBE_INFERENCE_URLS=url, RLKUBE_INDEX=str(index),
                            **env)


def groups(redis_client) -> list[protocol.RolloutGroup]:
    return [protocol.RolloutGroup.decode(f) for _, f in redis_client.xrange(KEYS.rollouts)]


def reserved(redis_client) -> int:
    return int(redis_client.get(LAG.reserved) or 0)


def settled(redis_client, want: int, written_too: bool = True) -> None:
    """Wait until the reserved counter (and the written one) is `want`. A holding actor reserves optimistically
    (INCRBY, then DECRBY when over the bound: core/actor/lag.py), so one read may catch a reservation in flight."""
    wait_for(lambda: reserved(redis_client) == want and (not written_too or written(redis_client) == want), 10,
               f"reserved{' and written' if written_too else ''} == {want}")


def written(redis_client) -> int:
    return int(redis_client.get(LAG.written) or 0)


def holds(proc) -> int:
    return len(re.findall(r"holding: ", log_text(proc)))


def test_two_replicas_hold_at_max_lag_and_resume_on_weights_ready(stack, redis_client):
    # groupSize 4, samplesPerStep 8, maxLag 1: (1+1) x 8 = 16 samples = 4 groups may be ahead of the trainer.
    roles, url, _, trainer, _ = stack(groupSize=4, samplesPerStep=8, maxLag=1)
    actors = [start_actor(roles, url, i) for i in (0, 1)]
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 4 and all(holds(a) for a in actors), 60,
               "4 groups and both replicas holding")
    settled(redis_client, 16)  # full until the trainer moves
    assert redis_client.xlen(KEYS.rollouts) == 4

    before = holds(actors[0]) + holds(actors[1])
    publish(trainer, 1, documents_seen=8)  # one step consumed 8 documents: room for 2 more groups
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 6 and holds(actors[0]) + holds(actors[1]) > before, 60,
               "2 more groups, then holding again")
    settled(redis_client, 24)
    assert redis_client.xlen(KEYS.rollouts) == 6

    got = groups(redis_client)
    assert len({g.group_id for g in got}) == 6
    assert {g.actor for g in got} <= {"actor-0", "actor-1"}
    assert [g.model_version for g in got[:4]] == [0, 0, 0, 0]
    assert all(g.model_version in (0, 1) for g in got[4:])
    for g in got:
        assert g.expected_size == 4 and len(g.samples) == 4
        assert re.fullmatch(r"\d+:", roles_tokenizer_decode(g.prompt_tokens))
        for s in g.samples:
            assert len(s.completion_tokens) == len(s.logprobs) >= 1
            assert all(lp <= 0 for lp in s.logprobs)
            assert 0.0 <= s.reward <= 1.0

    redis_client.xadd(KEYS.events, protocol.training_finished(step=1))
    for a in actors:
        assert a.wait(timeout=20) == 0, log_text(a)


def roles_tokenizer_decode(ids: list[int]) -> str:
    """The job's tokenizer (the built-in model's) decoding `ids` (special tokens such as <bos> dropped)."""
    from support.hf_models import builtin_dir
    from rlkube.core.hf.loading import load_tokenizer

    return load_tokenizer(builtin_dir(seed=7)).decode(ids)


def test_restarted_trainer_lowers_the_lag_credit(stack, redis_client):
    roles, url, _, trainer, _ = stack(groupSize=4, samplesPerStep=8, maxLag=1)
    publish(trainer, 1, documents_seen=8)
    publish(trainer, 2, documents_seen=16)
    actor = start_actor(roles, url)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 8 and holds(actor), 60, "8 groups, holding")
    settled(redis_client, 32, written_too=False)

    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=10)
    second = roles.start_trainer(1)  # resumed from its step-1 checkpoint: 8 documents seen, not 16
    wait_for(lambda: "lag credit lowered by 8" in log_text(actor), 60, "the rebase")
    settled(redis_client, 24)
    publish(second, 2, documents_seen=16)  # without the rebase the counter (32) would stay full here
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 10, 60, "2 more groups after the restart")
    redis_client.xadd(KEYS.events, protocol.training_finished(step=2))
    assert actor.wait(timeout=20) == 0


def test_stops_on_training_finished_and_not_on_counts(stack, redis_client):
    # maxSteps 1 x samplesPerStep 4 is one group; a count-based actor would stop there.
    roles, url, _, _, _ = stack(maxSteps=1, groupSize=4, samplesPerStep=4, maxLag=20)
    actor = start_actor(roles, url)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= 4, 60, "more groups than maxSteps x samplesPerStep")
    assert actor.poll() is None
    redis_client.xadd(KEYS.events, protocol.training_finished(step=1))
    assert actor.wait(timeout=20) == 0
    assert "training_finished" in log_text(actor)


def test_sigterm_exits_zero_and_returns_unused_credit(stack, redis_client):
    roles, url, _, _, _ = stack(groupSize=4, samplesPerStep=4, maxLag=0)
    actor = start_actor(roles, url)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 1 and holds(actor), 60, "one group, then holding")
    actor.send_signal(signal.SIGTERM)
    assert actor.wait(timeout=20) == 0
    assert reserved(redis_client) == written(redis_client) == 4  # the produced group; no reservation leaked


def test_dead_inference_server_is_retried(stack, redis_client):
    roles, url, server, _, port = stack(groupSize=4, samplesPerStep=4, maxLag=50)
    actor = start_actor(roles, url, RLKUBE_ACTOR_STALL_SECONDS="5")
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= 2, 60, "first groups")
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)
    wait_for(lambda: "inference request failed" in log_text(actor), 60, "a failed request")
    count = redis_client.xlen(KEYS.rollouts)
    roles.start_role("inference", RLKUBE_PORT=str(port))  # same address, e.g. the pod restarted in place
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= count + 2, 60, "groups after the restart")
    assert actor.poll() is None
    redis_client.xadd(KEYS.events, protocol.training_finished(step=1))
    assert actor.wait(timeout=20) == 0


def test_reservations_of_a_killed_actor_are_dropped_when_the_pipeline_stalls(stack, redis_client):
    # maxLag 0, 8 samples per step: two groups may be ahead. A killed actor left one group reserved, unwritten.
    roles, url, _, _, _ = stack(groupSize=4, samplesPerStep=8, maxLag=0)
    redis_client.set(LAG.reserved, 4)
    actor = start_actor(roles, url, RLKUBE_ACTOR_STALL_SECONDS="1")
    wait_for(lambda: "released unwritten reservations" in log_text(actor), 60, "the stall release")
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) == 2, 60, "the second group")
    assert reserved(redis_client) == written(redis_client) == 8
    redis_client.xadd(KEYS.events, protocol.training_finished(step=0))
    assert actor.wait(timeout=20) == 0


FLAKY_REWARD = """
calls = 0


def score(completion, answer, sample):
    global calls
    calls += 1
    if calls % 2 == 0:
        raise RuntimeError(f"reward service down (call {calls})")
    return 0.5 if answer == str(eval(sample["question"][:-1])) else -1.0
"""


def test_dataset_prompts_and_a_reward_that_raises_score_zero_and_are_counted(stack, redis_client, tmp_path):
    (tmp_path / "flaky_reward.py").write_text(FLAKY_REWARD)
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6))]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"name": "sums", "dataset": {"path": str(tmp_path / "sums.jsonl"), "promptField": "question"},
            "reward": {"type": "python", "function": "flaky_reward:score"}}
    roles, url, _, _, _ = stack(task=task, groupSize=4, samplesPerStep=8, maxLag=50)
    actor = start_actor(roles, url, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= 6, 60, "six groups")
    assert actor.poll() is None  # the failures did not stop it
    got = groups(redis_client)
    # the rows are drawn an epoch (3 groups) at a time; with 2 workers at most one draw is still in flight, so 6
    # written groups hold every row, each prompt exactly as written
    assert {roles_tokenizer_decode(g.prompt_tokens) for g in got} == {r["question"] for r in rows}
    # rendered by the built-in model's chat template, which writes <bos> (id 1): sent as ids, so inference does not
    # add a second one
    assert all(g.prompt_tokens[0] == 1 and g.prompt_tokens[1] != 1 for g in got), [g.prompt_tokens for g in got]
    for g in got:
        # each group's 4 completions are scored one after another: calls 2 and 4 of every 4 raised
        assert [s.reward_error for s in g.samples] == [False, True, False, True], g
        assert [s.reward for s in g.samples] == [0.5, 0.0, 0.5, 0.0]  # 0.5: the function got the row's answer
    assert "reward of task sums failed" in log_text(actor) and "reward service down" in log_text(actor)
    redis_client.xadd(KEYS.events, protocol.training_finished(step=1))
    assert actor.wait(timeout=20) == 0, log_text(actor)
    m = re.search(r"(\d+) reward errors in (\d+) completions scored", log_text(actor))
    assert m and int(m.group(2)) >= 4 * len(got) and int(m.group(1)) * 2 == int(m.group(2)), m


def test_a_dataset_without_the_mapped_column_stops_the_actor_naming_the_field(tmp_path, redis_server):
    (tmp_path / "sums.jsonl").write_text(json.dumps({"question": "1+2=", "answer": "3"}) + "\n")
    task = {"dataset": {"path": str(tmp_path / "sums.jsonl"), "promptField": "problem"}, "reward": {"type": "math"}}
    roles = make_roles(tmp_path, redis_server, task)
    termination = tmp_path / "termination-log"
    try:
        # never asked: the task fails first
        actor = start_actor(roles, "http://127.0.0.1:9", **{runtime.ENV_TERMINATION_LOG: str(termination)})
        assert actor.wait(timeout=60) == runtime.EXIT_CONFIG, log_text(actor)
        message = termination.read_text()
        assert message.startswith("spec.task.dataset.promptField: no column 'problem' in ")
        assert message.endswith("(columns: question, answer)")
        assert message in log_text(actor) and "Traceback" not in log_text(actor)
    finally:
        roles.cleanup()
