"""SIGTERM ends the inference server and the actor promptly, with exit 0, whatever they are doing.

A TrainingJob's teardown stops the actors, then the preprocessors, then the inference servers while the trainer
still runs (it may be between steps, waiting for documents, or frozen), and SIGKILLs whatever outlives its grace
period (a few seconds). Every state is reached for real, with real processes, real Redis and a real
weight-update group, and checked before the signal is sent:

- inference: never joined a group; idle after an update; serving (generation going on, and a request waiting
  for a newer version whose transfer does not come); in the group's rendezvous of an announced epoch whose
  trainer never forms it; in the same with the trainer's store gone; joined and waiting in the receive of an
  update the (live) trainer does not send.
- actor: waiting for inference health; holding at the lag bound; in requests the server holds (a
  min_model_version whose transfer does not come); in requests to a frozen (SIGSTOPped) server.

The exit must come within EXIT_LIMIT_S of the signal (the time is printed with -s).
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import pytest
from rlkube.contract import protocol
from rlkube.core.actor.lag import LagKeys
from rlkube.core.weights.group import WeightSender
from support.serve_helpers import (
    PREFIX,
    RoleProcesses,
    free_port,
    http_json,
    http_status,
    job_spec,
    log_text,
    wait_for,
    write_config,
)

KEYS = protocol.StreamKeys(PREFIX)
LAG = LagKeys.for_job(KEYS)
EXIT_LIMIT_S = 2.0  # the e2e chaos tests give inference and actors 3 s of grace
PROMPT = "123:"


def sigterm(proc, what: str) -> float:
    """SIGTERM `proc`; assert it exits 0 within EXIT_LIMIT_S; return how long it took."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=EXIT_LIMIT_S + 10)  # long enough to tell "slow" from "hung" in the message
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - t0
    print(f"\n{what}: exit {code} {took:.2f}s after SIGTERM")
    tail = "\n".join(log_text(proc).splitlines()[-15:])
    assert code == 0, f"{what}: exit code {code} ({took:.1f}s after SIGTERM)\n{tail}"
    assert took < EXIT_LIMIT_S, f"{what}: exit took {took:.2f}s (limit {EXIT_LIMIT_S}s)\n{tail}"
    return took


@pytest.fixture
def roles(tmp_path, redis_server, redis_client):
    procs = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, job_spec(groupSize=4, samplesPerStep=8,
                                                                                       maxLag=1)))
    senders: list[WeightSender] = []
    procs.senders = senders  # type: ignore[attr-defined]
    yield procs
    procs.cleanup()
    for sender in senders:
        sender.close()


def start_server(roles: RoleProcesses) -> tuple[str, object]:
    port = free_port()
    proc = roles.start_role("inference", RLKUBE_PORT=str(port))
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_status(url + "/v1/models") == 200 or proc.poll() is not None, 60, "the server")
    assert proc.poll() is None, log_text(proc)
    return url, proc


def health(url: str) -> dict:
    return http_json(url + "/health", timeout=5)[1]


def synced_server(roles: RoleProcesses):
    """An inference server that received version 0 from a trainer stand-in (a separate process)."""
    url, proc = start_server(roles)
    roles.start_trainer(0)
    wait_for(lambda: health(url)["updates"] >= 1, 60, "the first update")
    return url, proc


def announce_epoch(roles: RoleProcesses, redis_client, version: int = 1, documents_seen: int = 8) -> WeightSender:
    """What a trainer does before a transfer: open an epoch (its store) and announce it. Nothing is sent."""
    sender = WeightSender(roles.weight_sync_addr, world_size=2, timeout_s=60)
    roles.senders.append(sender)  # type: ignore[attr-defined]
    epoch = sender.open()
    redis_client.xadd(KEYS.events, protocol.weights_ready(version, documents_seen, epoch=epoch, version=version))
    return sender


# --- inference ----------------------------------------------------------------------------------------------


def test_inference_never_joined(roles):
    url, proc = start_server(roles)
    body = health(url)
    assert body["epoch"] is None and body["updates"] == 0
    sigterm(proc, "inference, never joined")


def test_inference_idle_after_an_update(roles):
    url, proc = synced_server(roles)
    assert health(url)["status"] == "ok"
    sigterm(proc, "inference, idle")


def test_inference_serving_with_a_request_waiting_for_a_version(roles):
    url, proc = synced_server(roles)
    replies: list[tuple[int, dict]] = []
    stop = threading.Event()

    def waiting_request():  # asks for weights that are never sent: the engine holds it (MIN_VERSION_WAIT_S)
        replies.append(http_json(url + "/v1/completions", {"prompt": PROMPT, "n": 2, "max_tokens": 4,
                                                           "min_model_version": 5}, timeout=30))

    def load():
        while not stop.is_set():
            try:
                http_json(url + "/v1/completions", {"prompt": PROMPT, "n": 32, "max_tokens": 8}, timeout=30)
            except OSError:
                return  # the server went away

    before = health(url)["requests"]
    waiter = threading.Thread(target=waiting_request, daemon=True)
    waiter.start()
    wait_for(lambda: health(url)["requests"] > before, 10, "the waiting request in the engine")
    loaders = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in loaders:
        t.start()
    counted = health(url)["requests"]
    wait_for(lambda: health(url)["requests"] >= counted + 3, 20, "generation under load")
    try:
        sigterm(proc, "inference, serving")
    finally:
        stop.set()
    waiter.join(timeout=10)
    assert replies and replies[0][0] == 503, replies  # answered at shutdown, not served after the signal


def test_inference_in_the_rendezvous_of_an_epoch_never_formed(roles, redis_client):
    _, proc = start_server(roles)
    sender = announce_epoch(roles, redis_client)
    keys = sender._store.num_keys()
    # The server's transport handshake (one key), then its rendezvous address in the trainer's store: it is inside
    # the group's constructor now.
    wait_for(lambda: sender._store.num_keys() > keys + 1, 30, "the server in the group's rendezvous")
    sigterm(proc, "inference, in the rendezvous")


def test_inference_joining_while_the_trainers_store_is_gone(roles, redis_client):
    _, proc = start_server(roles)
    # Announced by a trainer that died before its store served anyone: the server keeps trying to connect.
    redis_client.xadd(KEYS.events, protocol.weights_ready(1, 8, epoch="0-gone", version=1))
    wait_for(lambda: "joining weight-update epoch 0-gone" in log_text(proc), 30, "the join")
    sigterm(proc, "inference, joining an unreachable store")


def test_inference_in_a_receive_the_live_trainer_does_not_send(roles, redis_client):
    url, proc = start_server(roles)
    sender = announce_epoch(roles, redis_client)
    formed = threading.Thread(target=sender.form, daemon=True)
    formed.start()
    formed.join(timeout=30)
    assert not formed.is_alive() and sender.pg is not None
    # Joined (the epoch is the server's) and no update arrived: its follower is in the receive.
    wait_for(lambda: health(url)["epoch"] == sender.epoch, 10, "the joined epoch")
    assert health(url)["updates"] == 0
    sigterm(proc, "inference, in a receive")


# --- actor --------------------------------------------------------------------------------------------------


def start_actor(roles: RoleProcesses, url: str):
    return roles.start_role("actor", RLKUBE_INFERENCE_URLS=url)


def counters(redis_client) -> tuple[int, int]:
    return int(redis_client.get(LAG.reserved) or 0), int(redis_client.get(LAG.written) or 0)


def wait_full(redis_client) -> None:
    """Until the actor is full at the lag bound with nothing in flight: (maxLag 1 + 1) x 8 = 16 samples reserved,
    every one written (so no request is under way and none can start before the next weights_ready)."""
    wait_for(lambda: counters(redis_client) == (16, 16), 60, "16 samples reserved and written")


def assert_no_reservation_leaked(redis_client) -> None:
    reserved, written = counters(redis_client)
    assert reserved == written, f"{reserved} samples reserved, {written} written"


def test_actor_waiting_for_inference_health(roles):
    url, _ = start_server(roles)  # never joins a group: /health stays 503
    actor = start_actor(roles, url)
    wait_for(lambda: "waiting for inference health" in log_text(actor), 30, "the actor waiting")
    sigterm(actor, "actor, waiting for inference health")


def test_actor_holding_at_the_lag_bound(roles, redis_client):
    url, _ = synced_server(roles)
    actor = start_actor(roles, url)
    wait_full(redis_client)
    wait_for(lambda: "holding:" in log_text(actor), 10, "the actor holding")
    sigterm(actor, "actor, holding")
    assert_no_reservation_leaked(redis_client)


def test_actor_in_requests_the_server_holds(roles, redis_client):
    url, _ = synced_server(roles)
    actor = start_actor(roles, url)
    wait_full(redis_client)
    before = health(url)["requests"]
    # Version 1 announced (8 documents consumed: room for 2 more groups) without an epoch, so the server never
    # gets it: the actor's next requests ask for it, and the server holds them (MIN_VERSION_WAIT_S).
    redis_client.xadd(KEYS.events, protocol.weights_ready(1, 8, version=1))
    wait_for(lambda: health(url)["requests"] > before, 30, "requests waiting for version 1")
    sigterm(actor, "actor, in held requests")
    assert_no_reservation_leaked(redis_client)


def test_actor_in_requests_to_a_frozen_server(roles, redis_client):
    url, server = synced_server(roles)
    actor = start_actor(roles, url)
    wait_full(redis_client)
    server.send_signal(signal.SIGSTOP)  # connections are accepted by the kernel, never answered
    try:
        redis_client.xadd(KEYS.events, protocol.weights_ready(1, 8, version=1))
        # Room for 2 more groups: reserved after the freeze, so their requests cannot be answered.
        wait_for(lambda: counters(redis_client)[0] > 16, 30, "a reservation after the freeze")
        sigterm(actor, "actor, requests to a frozen server")
        assert_no_reservation_leaked(redis_client)
    finally:
        server.send_signal(signal.SIGCONT)
