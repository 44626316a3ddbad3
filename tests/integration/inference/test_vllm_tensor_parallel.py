"""`engine: vllm` with spec.inference.tensorParallel 2 on CPU: one server runs two vLLM workers (processes, gloo/shm
between them), and each worker is its own rank of the weight-update group (1 + replicas x tensorParallel ranks:
rlkube.contract.runtime.weight_sync_world_size). Both receive the trainer's full broadcast and keep their shards
through vLLM's weight loaders; afterwards the fixed prompt's log-probs are transformers' with the new weights.

One test, one server (starting it costs ~1-2 min on 2 cores); the per-update behaviour is covered with one worker
in test_vllm_server.py.
"""

from __future__ import annotations

import time

import psutil
from rlkube.core.inference.vllm_engine import ENV_VLLM_PYTHON
from rlkube.core.weights.wire import checksums_match, weights_checksum
from support.serve_helpers import (
    RoleProcesses, free_port, http_status, job_spec, log_text, publish, wait_for, write_config,
)
from test_vllm_server import (
    LOGPROB_TOLERANCE,
    MAX_LEN,
    VLLM_PYTHON,
    complete,
    health,
    max_difference,
    pytestmark,
    wait_version,
)
from support.weightsync_peer import model_weights

__all__ = ["pytestmark"]  # the vllm marker and the skip without a vLLM environment, as test_vllm_server's

TP = 2


def test_a_tensor_parallel_server_joins_as_one_rank_per_worker_and_serves_the_update(tmp_path, redis_server):
    spec = job_spec()
    spec["model"]["maxSequenceLength"] = MAX_LEN
    spec["inference"] = {"engine": "vllm", "replicas": 1, "tensorParallel": TP,
                         "vllm": {"extraEngineArgs": ["--block-size=32", "--max-num-seqs=32"]}}
    roles = RoleProcesses(tmp_path, redis_server.url, write_config(tmp_path, spec))
    client = redis_server.client()
    client.flushall()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = roles.start_role("inference", RLKUBE_PORT=str(port), RLKUBE_INDEX="0", **{ENV_VLLM_PYTHON: VLLM_PYTHON})
    children = []
    try:
        t0 = time.monotonic()
        wait_for(lambda: http_status(url + "/v1/models") == 200 or proc.poll() is not None, 300, "the vLLM server")
        assert proc.poll() is None, f"the vLLM server exited with {proc.returncode}:\n{log_text(proc)[-5000:]}"
        print(f"tensor-parallel vLLM server listening after {time.monotonic() - t0:.1f}s")
        children = psutil.Process(proc.pid).children(recursive=True)
        # the trainer's side of a group of 1 + 1 x TP ranks: it forms only when both workers joined
        trainer = roles.start_trainer(0, world_size=1 + TP)
        first = wait_version(url, 0, timeout=180)
        assert first["weight_sync_ranks"] == [1, 2] and first["updates"] == 1
        assert max_difference(roles.config, model_weights(str(roles.config), 0), complete(url)) < LOGPROB_TOLERANCE

        publish(trainer, 1)
        served = wait_version(url, 1, timeout=120)
        new, old = model_weights(str(roles.config), 1), model_weights(str(roles.config), 0)
        reply = complete(url)
        assert reply["model_version"] == 1
        worst = max_difference(roles.config, new, reply)
        print(f"TP={TP}: max |log-prob - transformers'| after the update {worst:.2e}")
        assert worst < LOGPROB_TOLERANCE
        assert max_difference(roles.config, old, reply) > 0.1, "the update did not change the served distribution"
        # each worker verified the full broadcast; the server reports what arrived (shards are not whole tensors)
        assert served["weights_checksum_source"] == "received"
        assert checksums_match(served["weights_checksum"], weights_checksum(new.items()))
        assert health(url)[1]["rejected_updates"] == 0
    finally:
        if not children and proc.poll() is None:
            children = psutil.Process(proc.pid).children(recursive=True)
        roles.cleanup()
        _, alive = psutil.wait_procs(children, timeout=15)
        for child in alive:
            child.kill()
        client.close()
        assert not alive, f"vLLM processes outlived the SIGKILLed server: {alive}"
