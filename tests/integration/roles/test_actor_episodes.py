"""The actor running multi-turn episodes (spec.task.environment) as a real process against the real native engine,
real Redis and a trainer stand-in that publishes new weights while episodes run.

A recording proxy between the actor and the engine keeps every request and reply, so the documents the trainer
would receive (the preprocessor's, from the rollouts the actor wrote) are checked against what the engine really
sampled: tokens = its sampled ids and the appended environment ids in order, environment tokens out of the loss,
each sampled token's log-prob and weight version as the engine reported them. Also: a tool that hangs is timed out,
the episode scored and counted, the actor goes on; an episode over its token budget is truncated and counted;
sandboxed tools (rlkube.core.actor.sandbox) refused the network and killed at their timeout, an episode over its time
limit ended, all counted, while the actor goes on.
"""

from __future__ import annotations

import json
import os
import select
import socket
import textwrap
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from rlkube.contract import protocol
from rlkube.core.actor.calculator import calculate
from rlkube.core.hf.builtin import char_tokenizer
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON
from support.serve_helpers import (
    PREFIX, RoleProcesses, free_port, http_status, job_spec, log_text, publish, wait_for, write_config,
)
from support import ROOT

KEYS = protocol.StreamKeys(PREFIX)
TOK = char_tokenizer()
VLLM_PYTHON = os.environ.get(ENV_VLLM_PYTHON) or str(ROOT / ".venv-vllm" / "bin" / "python")


class RecordingProxy:
    """Forwards /health and /v1/completions to `upstream`, keeping every (request, reply) of a completion."""

    def __init__(self, upstream: str):
        self.records: list[tuple[dict, dict]] = []
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _forward(self, body: bytes | None):
                req = urllib.request.Request(upstream + self.path, data=body,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=300) as resp:
                        status, data = resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                if body is not None and status == 200:
                    with lock:
                        proxy.records.append((json.loads(body), json.loads(data)))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._forward(None)

            def do_POST(self):
                self._forward(self.rfile.read(int(self.headers["Content-Length"])))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stack(tmp_path, redis_server, redis_client):
    """Factory: inference server behind a recording proxy + trainer stand-in (version 0 announced)."""
    made: list[RoleProcesses] = []
    proxies: list[RecordingProxy] = []

    def start(environment: dict, engine: str = "native", **algorithm):
        spec = job_spec(**{"groupSize": 4, "samplesPerStep": 8, "maxLag": 1, "maxNewTokens": 3, **algorithm})
        spec["task"] = {"name": "calculator", "environment": environment}
        port = free_port()
        if engine == "vllm":
            spec["inference"] = {"engine": "vllm", "replicas": 1,
                                 "vllm": {"extraEngineArgs": ["--block-size=32", "--max-num-seqs=32"]}}
        roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
        # Cleaned up even when the server never becomes healthy (a vLLM engine left running holds GiBs).
        made.append(roles)
        if engine == "vllm":
            server = roles.start_role("inference", RLKUBE_PORT=str(port), RLKUBE_INDEX="0",
                                      **{ENV_VLLM_PYTHON: VLLM_PYTHON})
        else:
            server = roles.start_role("inference", RLKUBE_PORT=str(port))
        url = f"http://127.0.0.1:{port}"
        trainer = roles.start_trainer(0)
        wait_for(lambda: http_status(url + "/health") == 200 or server.poll() is not None, 400, "inference health")
        assert server.poll() is None, log_text(server)
        proxy = RecordingProxy(url)
        proxies.append(proxy)
        return roles, proxy, trainer

    yield start
    for roles in made:
        roles.cleanup()
    for proxy in proxies:
        proxy.close()


def per_token(choice: dict) -> list[int]:
    """The engine's version of each token of a choice, from its `model_versions` [[first index, version], ...]."""
    spans = choice["model_versions"]
    return [max((first, v) for first, v in spans if first <= i)[1] for i in range(len(choice["token_ids"]))]


def counts(redis_client) -> dict[str, float]:
    return {k.decode(): float(v) for k, v in redis_client.hgetall(KEYS.episodes).items()}


def written(redis_client) -> tuple[list[protocol.RolloutGroup], dict[str, float]]:
    """The groups and the episode totals read in one transaction: the actor goes on writing while the test reads,
    and each group is written together with its counts (rlkube.core.actor.lag), so only one snapshot compares."""
    pipe = redis_client.pipeline(transaction=True)
    pipe.xrange(KEYS.rollouts)
    pipe.hgetall(KEYS.episodes)
    stream, totals = pipe.execute()
    return ([protocol.RolloutGroup.decode(f) for _, f in stream],
            {k.decode(): float(v) for k, v in totals.items()})


@pytest.mark.parametrize("engine", [
    "native",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
        not os.access(VLLM_PYTHON, os.X_OK), reason=f"no vLLM environment at {VLLM_PYTHON}")]),
])
def test_every_document_is_exactly_what_the_engine_sampled_plus_the_environment(stack, redis_client, engine):
    roles, proxy, trainer = stack({"name": "calculator", "maxTurns": 3, "params": {"callCredit": 0.5}}, engine)
    actor = roles.start_role("actor", RLKUBE_INFERENCE_URLS=proxy.url, RLKUBE_INDEX="0")
    # maxLag 1, 8 samples per step: 4 groups ahead; each new version lets 2 more through, sampled across updates.
    for version in range(1, 5):
        wait_for(lambda v=version: redis_client.xlen(KEYS.rollouts) >= 2 + 2 * v or actor.poll() is not None, 120,
                 f"groups before version {version}")
        publish(trainer, version, documents_seen=8 * version)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= 10 or actor.poll() is not None, 120, "10 groups")
    assert actor.poll() is None, log_text(actor)
    groups, totals = written(redis_client)

    # The engine's replies by the prompt ids they answered (a text prompt: the ids the engine reported for it).
    replies: dict[tuple[int, ...], list[tuple[dict, dict]]] = {}
    for request, reply in proxy.records:
        for choice in reply["choices"]:
            prompt = request["prompt"] if isinstance(request["prompt"], list) else choice["prompt_token_ids"]
            replies.setdefault(tuple(prompt), []).append((choice, reply))
    docs_checked = env_spans = 0
    versions_seen: set[int] = set()
    for group in groups:
        docs = group_to_documents(group, DocumentConfig())
        assert len(docs) == len(group.samples) == 4
        question = TOK.decode(group.prompt_tokens, skip_special_tokens=True).rstrip("=")
        tool_ids = TOK(calculate(question), add_special_tokens=False)["input_ids"]
        for doc in (protocol.decode_document(protocol.encode_document(d)) for d in docs):
            tokens, mask, at = doc.tokens.tolist(), doc.loss_mask(), len(group.prompt_tokens)
            assert not mask[:at].any()
            while at < len(tokens):
                # One of the engine's replies to exactly tokens[:at] is this span, with its log-probs and version.
                choice, reply = next(
                    (c, r) for c, r in replies[tuple(tokens[:at])]
                    if tokens[at:at + len(c["token_ids"])] == c["token_ids"]
                    and np.allclose(doc.old_log_probabilities[at:at + len(c["token_ids"])],
                                    c["logprobs"]["token_logprobs"], atol=1e-6)
                    and doc.model_version[at:at + len(c["token_ids"])].tolist() == per_token(c))
                end = at + len(choice["token_ids"])
                assert mask[at:end].all()
                versions_seen.update(per_token(choice))
                at = end
                if at < len(tokens):  # the calculator's answer, appended as ids, out of the loss
                    assert tokens[at:at + len(tool_ids)] == tool_ids and not mask[at:at + len(tool_ids)].any()
                    assert (doc.old_log_probabilities[at:at + len(tool_ids)] == 0).all()
                    at += len(tool_ids)
                    env_spans += 1
            docs_checked += 1
    assert docs_checked >= 40 and env_spans >= 1, (docs_checked, env_spans)
    assert len(versions_seen) >= 2  # the documents span weight updates
    assert totals["episodes"] == sum(len(g.samples) for g in groups)
    assert totals["tool_calls"] == env_spans == sum(s.episode["tool_calls"] for g in groups for s in g.samples)


def test_a_hanging_tool_and_a_spent_token_budget_end_episodes_that_are_scored_and_counted(stack, redis_client,
                                                                                           tmp_path):
    (tmp_path / "hanging_env.py").write_text(textwrap.dedent("""
        import threading

        from rlkube.core.actor.calculator import Calculator, CalculatorEpisode

        NEVER = threading.Event()


        class Hangs(CalculatorEpisode):
            def respond(self, reply):
                if reply[:1].isdigit():
                    NEVER.wait()  # a tool that never answers
                self.called = True
                return [{"role": "tool", "content": self.result}]  # always answers: episodes run to the budget


        class HangingCalculator(Calculator):
            def start(self, prompt):
                return Hangs(prompt.meta["question"], prompt.meta["answer"], 0.25, 0.5)


        def make(**params):
            return HangingCalculator(**params)
    """))
    # A reply starting with a digit hangs the tool; every other one is answered, until the token budget is spent.
    roles, proxy, trainer = stack({"entryPoint": "hanging_env:make", "maxTurns": 6, "maxEpisodeTokens": 12,
                                   "toolTimeoutSeconds": 0.5})
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    actor = roles.start_role("actor", RLKUBE_INFERENCE_URLS=proxy.url, RLKUBE_INDEX="0", PYTHONPATH=pythonpath)
    for version in range(1, 6):
        wait_for(lambda v=version: redis_client.xlen(KEYS.rollouts) >= 2 + 2 * v or actor.poll() is not None, 120,
                 f"groups before version {version}")
        assert actor.poll() is None, log_text(actor)
        publish(trainer, version, documents_seen=8 * version)
        if counts(redis_client).get("tool_timeouts", 0) and counts(redis_client).get("truncated", 0):
            break
    # The actor went on after the timeouts: groups keep coming.
    before = redis_client.xlen(KEYS.rollouts)
    publish(trainer, 10, documents_seen=80)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= before + 2 or actor.poll() is not None, 120,
             "groups after the timeouts")
    assert actor.poll() is None, log_text(actor)
    groups, totals = written(redis_client)
    samples = [s for g in groups for s in g.samples]
    timed_out = [s for s in samples if s.episode["tool_timeouts"]]
    truncated = [s for s in samples if s.episode["truncated"]]
    assert timed_out and truncated
    assert totals["tool_timeouts"] == len(timed_out) and totals["truncated"] == len(truncated)
    assert totals["episodes"] == len(samples)
    for s in timed_out:  # ended at the hung call and scored by the environment (its reward() answered)
        assert not s.reward_error and s.reward >= 0.0 and not s.episode["truncated"]
    for g in groups:
        for s in g.samples:
            assert len(g.prompt_tokens) + len(s.completion_tokens) <= 12  # maxEpisodeTokens
            if s.episode["truncated"]:
                assert not s.finished and s.episode["tool_timeouts"] == 0
    assert "took over 0.5s" in log_text(actor)


def test_sandboxed_tools_refused_network_killed_loops_and_an_episode_time_limit_in_a_running_actor(
        stack, redis_client, tmp_path):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    (tmp_path / "code_env.py").write_text(textwrap.dedent("""
        from rlkube.core.actor.calculator import Calculator, CalculatorEpisode
        from rlkube.core.actor.episodes import Turn


        class Runs(CalculatorEpisode):
            def respond(self, reply):
                if reply[:1].isdigit():
                    answer = SANDBOX.python_tool("while True:\\n    pass")  # killed at the sandbox's timeout
                else:
                    answer = SANDBOX.python_tool(
                        f"import socket\\nsocket.create_connection(('127.0.0.1', {PORT}), timeout=2)")
                self.called = True
                # One character per answer, so the token budget leaves room for the episode's time limit; a
                # turn's reward (reported, not summed: episodeReward final) says which it was.
                content = "R" if "refused by" in answer else "T" if "wall time" in answer else "E"
                return Turn([{"role": "tool", "content": content}], reward={"R": 0.25, "T": 0.5}.get(content, 0))


        class Code(Calculator):
            def start(self, prompt):
                return Runs(prompt.meta["question"], prompt.meta["answer"], 0.25, 0.5)


        def make(sandbox, port):
            global SANDBOX, PORT
            SANDBOX, PORT = sandbox, port
            return Code()
    """))
    roles, proxy, trainer = stack({"entryPoint": "code_env:make", "params": {"port": listener.getsockname()[1]},
                                   "maxTurns": 6, "toolTimeoutSeconds": 10, "episodeTimeoutSeconds": 1.5,
                                   "sandbox": {"timeoutSeconds": 0.5}})
    pythonpath = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    actor = roles.start_role("actor", RLKUBE_INFERENCE_URLS=proxy.url, RLKUBE_INDEX="0", PYTHONPATH=pythonpath)
    for version in range(1, 8):
        wait_for(lambda v=version: redis_client.xlen(KEYS.rollouts) >= 2 + 2 * v or actor.poll() is not None, 180,
                 f"groups before version {version}")
        assert actor.poll() is None, log_text(actor)
        publish(trainer, version, documents_seen=8 * version)
        seen = counts(redis_client)
        if all(seen.get(k, 0) for k in ("sandbox_refusals", "tool_timeouts", "timed_out")):
            break
    before = redis_client.xlen(KEYS.rollouts)
    publish(trainer, 20, documents_seen=160)
    wait_for(lambda: redis_client.xlen(KEYS.rollouts) >= before + 2 or actor.poll() is not None, 180,
             "groups after the refusals, kills and time limits")
    assert actor.poll() is None, log_text(actor)
    groups, totals = written(redis_client)
    samples = [s for g in groups for s in g.samples]
    assert totals["episodes"] == len(samples)
    for key in ("sandbox_refusals", "tool_timeouts", "timed_out"):
        assert totals[key] == sum(s.episode[key] for s in samples) > 0, (key, totals)
    assert totals["tool_errors"] >= totals["sandbox_refusals"]
    assert totals["turn_rewards"] == sum(s.episode["turn_rewards"] for s in samples) > 0
    assert totals["turn_reward_sum"] > 0
    assert totals["turn_reward_sum"] == pytest.approx(sum(s.episode["turn_reward_sum"] for s in samples))
    print(f"\nsandboxed episodes: {totals}")
    for s in samples:
        if s.episode["timed_out"]:  # ended by its time limit, counted as truncated, scored by the environment
            assert s.episode["truncated"] and not s.finished and not s.reward_error
    # Every refused connection stayed refused: the listener never saw one.
    assert select.select([listener], [], [], 0.2)[0] == []
    listener.close()
