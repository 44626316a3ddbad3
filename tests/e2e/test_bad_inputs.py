"""Issue 9, must-show 6: a model or dataset that cannot work fails the job at once, naming the spec field, through
the real operator and API server with pods run by the node agent; and an `hf://` model through the model init
container, offline, from a pre-populated hub-cache claim.

The model directories live on a PersistentVolumeClaim (`spec.model.claimName`; the node agent maps a claim to a
host directory, which the test fills before the job starts). The node agent runs containers as root, so `chmod 000`
would not make anything unreadable: "unreadable" is a config.json that is not JSON and, separately, a
model.safetensors that is garbage (both caught by the init container, rlkube.core.hf.fetch). Model errors come from
the init container `model` of the trainer and inference pods; dataset errors from the actor, which reads the
dataset from its own claim (`spec.task.dataset.claimName`). Each exits runtime.EXIT_CONFIG (78) with its message
as termination message: Failed with reason InvalidSpec, the message names the field, restarts stay bounded, and
the ordered teardown completes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clusterjob import FULL_ORDER, ClusterJob, example, stage_names
from hf_models import bpe_tokenizer, write_tiny_model

from rlkube.controller import names

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
MAX_RESTARTS = 4
"""The reason InvalidSpec shows the job failed on the exit code 78, not on a restart budget; this bound says it did
so promptly. The count read at the end also holds the restarts during the teardown (the trainer goes last), under the
node agent's back-off of 1, 2, 4 s (the kubelet's starts at 10 s): CI, with five such jobs at once on two busy cores,
saw 3. Four restarts take 15 s of back-off alone."""


def claim_dir(core_api, node_agent, namespace: str, claim: str) -> Path:
    """Create the claim; the directory the node agent will mount for it (created now, so the test can fill it)."""
    pvc = core_api.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    })
    path = node_agent.state_dir / "claims" / namespace / f"{claim}-{pvc.metadata.uid}"
    path.mkdir(parents=True)
    return path


# -- what goes on the model claim -------------------------------------------------------------------------------


def _edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def bad_json(d: Path) -> None:
    write_tiny_model(d, "llama")
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')


def garbage_weights(d: Path) -> None:
    write_tiny_model(d, "llama")
    (d / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a safetensors file" * 100)


def unsupported(d: Path) -> None:
    write_tiny_model(d, "llama")
    _edit_config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2")


def tokenizer_mismatch(d: Path) -> None:
    write_tiny_model(d, "llama")  # character tokenizer, an embedding of a few dozen rows
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    bpe_tokenizer(vocab_size=300).save_pretrained(str(d))  # 300 tokens


MODEL_ROWS = {
    # row: (what goes on the claim at /models/<row>, the message's field, words in the message)
    "missing": (None, "spec.model.path", "/models/missing does not exist"),
    "config-not-json": (bad_json, "spec.model.path", "config.json is not valid JSON"),
    "garbage-weights": (garbage_weights, "spec.model.path", "is not a readable safetensors file"),
    "unsupported-architecture": (unsupported, "spec.model.path", "architecture 'GPT2LMHeadModel'"),
    "tokenizer-mismatch": (tokenizer_mismatch, "spec.model.path", "tokenizer and model do not match"),
}

DATASET_ROWS = {
    "dataset-missing": (None, "spec.task.dataset.path", "/data/dataset-missing.jsonl does not exist"),
    "dataset-lacks-field": ([{"question": "1+1", "answer": "2"}] * 4, "spec.task.dataset.promptField",
                            "no column 'prompt'"),
}


@pytest.fixture
def jobs(job, api_client, node_agent, namespace):
    """`jobs(n)`: the `job` fixture's handle and n-1 more in the same namespace. The rows of one table run as
    concurrent jobs (each fails within seconds of its pods starting: run one after another they spent most of
    the tier's time waiting for pods); the extra ones are deleted at the end as the fixture deletes its own."""
    extra: list[ClusterJob] = []

    def make(n: int) -> list[ClusterJob]:
        extra.extend(ClusterJob(api_client, node_agent, namespace) for _ in range(n - 1))
        return [job, *extra]

    yield make
    for j in extra:
        j.recorder.stop()
        if j.name and j.get() is not None:
            j.delete()
    for j in extra:
        if j.name:
            j.wait(lambda tj: tj is None, 120, f"TrainingJob {j.name} deleted after the test")


def assert_failed_naming(job, field: str, words: str) -> dict:
    tj = job.wait_phase(("Succeeded", "Failed"), 300)
    st = tj["status"]
    assert st["phase"] == "Failed" and st["reason"] == "InvalidSpec", job.diagnostics()
    message = next(c for c in st["conditions"] if c["type"] == "Failed")["message"]
    assert f"{field}: " in message and words in message, message
    restarts = {role: c.get("restarts", 0) for role, c in st["components"].items()}
    assert all(n <= MAX_RESTARTS for n in restarts.values()), restarts
    assert stage_names(st) == FULL_ORDER
    job.wait(lambda _: not job.children_left(), 60, "children garbage-collected")
    return st


def test_models_that_cannot_work_fail_their_jobs_from_the_init_container(jobs, core_api, node_agent, namespace):
    models = claim_dir(core_api, node_agent, namespace, "models")
    handles = dict(zip(MODEL_ROWS, jobs(len(MODEL_ROWS))))
    for row, job in handles.items():
        write = MODEL_ROWS[row][0]
        if write is not None:
            write(models / row)
        job.apply(example(**{"metadata.name": f"bad-{row}", "spec.model.path": f"/models/{row}",
                             "spec.model.claimName": "models"}))
    for row, job in handles.items():
        _, field, words = MODEL_ROWS[row]
        assert_failed_naming(job, field, words)
        # The roles never ran: the init container `model` of the trainer and inference pods failed first, and
        # the actors (which wait for inference) were never created.
        assert f"{job.name}-actor-0" not in job.uids_per_pod(), row
        logs = {}
        for role in ("trainer", "inference"):
            pod = names.pod_name(job.name, role)
            logs[pod] = node_agent.container_log(namespace, pod, names.INIT_MODEL)
            assert not node_agent.container_log(namespace, pod, role), f"{pod}: the role ran"
        # Both init containers check the model. The first to fail fails the job, and the teardown may stop the
        # other while it is still checking (CI, under load: the inference pod's log was empty), so only the one
        # that failed must have said why.
        assert any(words in log for log in logs.values()), logs
    assert job.leftover_processes() == []


def test_datasets_that_cannot_work_fail_their_jobs_from_the_actor(jobs, core_api, node_agent, namespace):
    data = claim_dir(core_api, node_agent, namespace, "prompts")
    handles = dict(zip(DATASET_ROWS, jobs(len(DATASET_ROWS))))
    for row, job in handles.items():
        rows = DATASET_ROWS[row][0]
        if rows is not None:
            (data / f"{row}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        job.apply(example(**{"metadata.name": f"bad-{row}",
                             "spec.task": {"name": "arithmetic",
                                           "dataset": {"path": f"/data/{row}.jsonl", "claimName": "prompts"},
                                           "reward": {"type": "exact"}}}))
    for row, job in handles.items():
        _, field, words = DATASET_ROWS[row]
        st = assert_failed_naming(job, field, words)
        failed = next(c for c in st["conditions"] if c["type"] == "Failed")["message"]
        assert failed.startswith(f"actor {job.name}-actor-0 cannot run: "), failed
    assert job.leftover_processes() == []


def _hub_snapshot(cache: Path, repo: str) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    org, name = repo.split("/")
    root = cache / "hub" / f"models--{org}--{name}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    return write_tiny_model(root / "snapshots" / SNAPSHOT, "llama")


def _offline_template() -> dict:
    """HF_HUB_OFFLINE=1 for the fetch (the init container): this cluster has no network, the cache is pre-filled."""
    return {role: {"spec": {"containers": [{"name": role, "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}]}}
            for role in ("trainer", "inference", "actor")}


def test_an_hf_model_runs_offline_from_a_prefilled_cache_claim(job, core_api, node_agent, namespace):
    cache = claim_dir(core_api, node_agent, namespace, "hub-cache")
    _hub_snapshot(cache, "org/tiny")
    manifest = example(**{"spec.model.path": "hf://org/tiny", "spec.model.cacheClaimName": "hub-cache",
                          "spec.algorithm.maxSteps": 2, "spec.trainer.checkpoint.intervalSteps": 2})
    for role, template in _offline_template().items():
        manifest["spec"][role]["template"] = template
    job.apply(manifest)
    tj = job.wait_phase(("Succeeded", "Failed"), 300)
    assert tj["status"]["phase"] == "Succeeded", job.diagnostics()
    snapshot = f"{names.MODEL_CACHE_MOUNT}/hub/models--org--tiny/snapshots/{SNAPSHOT}"
    for role in ("trainer", "inference", "actor"):
        log = node_agent.container_log(namespace, names.pod_name(job.name, role), names.INIT_MODEL)
        assert f"model hf://org/tiny ready at {snapshot}" in log, log
    # Nothing was downloaded or written beside the snapshot the test put there.
    assert sorted(p.name for p in (cache / "hub").iterdir()) == ["models--org--tiny"]


def test_a_missing_hf_model_offline_fails_naming_the_model_path(job, core_api, node_agent, namespace):
    claim_dir(core_api, node_agent, namespace, "hub-cache")
    manifest = example(**{"spec.model.path": "hf://org/missing", "spec.model.cacheClaimName": "hub-cache"})
    for role, template in _offline_template().items():
        manifest["spec"][role]["template"] = template
    job.apply(manifest)
    assert_failed_naming(job, "spec.model.path", "hf://org/missing: HF_HUB_OFFLINE is set and no complete snapshot")
    assert job.leftover_processes() == []
