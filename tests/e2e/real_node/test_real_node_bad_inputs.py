"""A model or dataset that cannot work fails the job at once, naming the spec field, through the chart's operator
on the real node (kubelet + containerd; moved here from the node agent); and an `hf://` model through the model init
container, offline, from a pre-filled hub-cache claim.

The model directories and datasets live on claims (hostPath PersistentVolumes the test fills before the job
starts). The pods run as uid 10001, so a file that is not readable is unreadable for real here (the agent ran
everything as root): one row makes config.json mode 000. Model errors come from the init container `model` of the
trainer and inference pods; dataset errors from the actor, which reads the dataset from its own claim
(`spec.task.dataset.claimName`). Each exits runtime.EXIT_CONFIG (78) with its message as its termination message,
which the kubelet reports: Failed with reason InvalidSpec, the message names the field, restarts stay bounded, the
ordered teardown completes and nothing of the job is left. The rows run as concurrent jobs, with CPU requests
small enough that their pods fit the node together (the init container asks no more than its role). A config.json
that is not JSON and an unsupported architecture, rows of the node agent's version, are the same path to the same
termination message: their words are checked in tests/unit/test_hf_models.py.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from support.clusterjob import FULL_ORDER, example, stage_names
from support.hf_models import bpe_tokenizer, write_tiny_model
from kubernetes import client
from support.realnode import LOCAL_IMAGES, ContainerRuns, PodWatch, RealJob, hostpath_claim
from support.waiting import wait_for

from rlkube.controller.manifests import names

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
MAX_RESTARTS = 4
"""The reason InvalidSpec shows the job failed on the exit code 78, not on a restart budget; this bound says it did
so promptly (the kubelet's back-off starts at 10 s: four restarts would take 150 s)."""
SMALL = {"requests": {"cpu": "50m", "memory": "256Mi"}}


def _on_this_node(**overrides) -> dict:
    return example(**{**LOCAL_IMAGES,
                      **{f"spec.{role}.resources": SMALL for role in ("trainer", "inference", "actor", "preprocessor")},
                      **overrides})


# -- what goes on the model claim -------------------------------------------------------------------------------


def garbage_weights(d: Path) -> None:
    write_tiny_model(d, "llama")
    (d / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a safetensors file" * 100)


def tokenizer_mismatch(d: Path) -> None:
    write_tiny_model(d, "llama")  # character tokenizer, an embedding of a few dozen rows
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)
    bpe_tokenizer(vocab_size=300).save_pretrained(str(d))  # 300 tokens


MODEL_ROWS = {
    # row: (what goes on the claim at /models/<row>, the message's field, words in the message)
    "missing": (None, "spec.model.path", "/models/missing does not exist"),
    "garbage-weights": (garbage_weights, "spec.model.path", "is not a readable safetensors file"),
    "tokenizer-mismatch": (tokenizer_mismatch, "spec.model.path", "tokenizer and model do not match"),
    # mode 000 after the claim is made readable below: refused to uid 10001, as root would not be
    "unreadable-config": (lambda d: write_tiny_model(d, "llama"), "spec.model.path",
                          "/models/unreadable-config/config.json is not readable"),
}

DATASET_ROWS = {
    "dataset-missing": (None, "spec.task.dataset.path", "/data/dataset-missing.jsonl does not exist"),
    "dataset-lacks-field": ([{"question": "1+1", "answer": "2"}] * 4, "spec.task.dataset.promptField",
                            "no column 'prompt'"),
}


def readable(*paths: Path) -> None:
    """Written by root here; the pods read them as uid 10001 (hostPath keeps the host's owners and modes)."""
    subprocess.run(["chmod", "-R", "a+rX", *map(str, paths)], check=True)


@pytest.fixture
def jobs(real_job, real_api, real_node):
    """`jobs(n)`: the `real_job` fixture's handle and n-1 more in its namespace, deleted at the end as it deletes
    its own. The rows of one table run as concurrent jobs: each fails within seconds of its pods starting."""
    extra: list[RealJob] = []

    def make(n: int) -> list[RealJob]:
        extra.extend(RealJob(real_api, real_node, real_job.namespace) for _ in range(n - 1))
        return [real_job, *extra]

    yield make
    for j in extra:
        j.close()
        if j.name and j.get() is not None:
            j.custom.delete_namespaced_custom_object("rlkube.io", "v1alpha1", j.namespace, "trainingjobs", j.name)
    for j in extra:
        if j.name:
            wait_for(lambda j=j: j.get() is None, 120, f"TrainingJob {j.name} deleted after the test")


def assert_failed_naming(job: RealJob, field: str, words: str) -> dict:
    tj = job.wait_phase(("Succeeded", "Failed"), 300)
    st = tj["status"]
    assert st["phase"] == "Failed" and st["reason"] == "InvalidSpec", job.diagnostics()
    message = next(c for c in st["conditions"] if c["type"] == "Failed")["message"]
    assert f"{field}: " in message and words in message, message
    restarts = {role: c.get("restarts", 0) for role, c in st["components"].items()}
    assert all(n <= MAX_RESTARTS for n in restarts.values()), restarts
    assert stage_names(st) == FULL_ORDER
    wait_for(lambda: not job.children_left(), 120, lambda: f"children removed: {job.children_left()}")
    return st


def started(pods: PodWatch, pod: str, container: str) -> bool:
    """Whether any object of that pod name ever had a container of that name started (it got an id)."""
    return any(container in by_name for by_name in pods.uids.get(pod, {}).values())


def test_models_and_datasets_that_cannot_work_fail_their_jobs_naming_the_field(jobs, real_api, real_node):
    """Every row of both tables at once, one job each: the model rows fail from the init container of the trainer
    and inference pods, the dataset rows from the actor."""
    handles = dict(zip([*MODEL_ROWS, *DATASET_ROWS], jobs(len(MODEL_ROWS) + len(DATASET_ROWS))))
    namespace = next(iter(handles.values())).namespace
    core = client.CoreV1Api(real_api)
    models = hostpath_claim(core, real_node, namespace, "models")
    data = hostpath_claim(core, real_node, namespace, "prompts")
    for row, (write, _, _) in MODEL_ROWS.items():
        if write is not None:
            write(models / row)
    for row, (rows, _, _) in DATASET_ROWS.items():
        if rows is not None:
            (data / f"{row}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    readable(models, data)
    (models / "unreadable-config" / "config.json").chmod(0)
    pods = PodWatch(real_api, namespace)
    pods.start()
    init_logs: dict[str, ContainerRuns] = {}
    for row, job in handles.items():
        name = f"bad-{row}-{uuid.uuid4().hex[:4]}"
        if row in MODEL_ROWS:
            for role in ("trainer", "inference"):
                pod = names.pod_name(name, role)
                init_logs[pod] = ContainerRuns(namespace, pod, names.INIT_MODEL)
                init_logs[pod].start()
            job.apply(_on_this_node(**{"metadata.name": name, "spec.model.path": f"/models/{row}",
                                       "spec.model.claimName": "models"}))
        else:
            job.apply(_on_this_node(**{"metadata.name": name, "spec.task": {
                "name": "arithmetic", "dataset": {"path": f"/data/{row}.jsonl", "claimName": "prompts"},
                "reward": {"type": "exact"}}}))
    for row, job in handles.items():
        if row in DATASET_ROWS:
            _, field, words = DATASET_ROWS[row]
            st = assert_failed_naming(job, field, words)
            failed = next(c for c in st["conditions"] if c["type"] == "Failed")["message"]
            assert failed.startswith(f"actor {job.pod('actor')} cannot run: "), failed
            continue
        _, field, words = MODEL_ROWS[row]
        assert_failed_naming(job, field, words)
        # The roles never ran: the init container `model` of the trainer and inference pods failed first, and
        # the actors (which wait for inference) were never created.
        assert job.pod("actor") not in pods.uids, row
        for role in ("trainer", "inference"):
            assert not started(pods, job.pod(role), role), f"{job.pod(role)}: the role ran"
        # Both init containers check the model. The first to fail fails the job, and the teardown may stop the
        # other while it is still checking, so only the one that failed must have said why.
        for role in ("trainer", "inference"):
            init_logs[job.pod(role)].stop()
        said = {role: init_logs[job.pod(role)].text for role in ("trainer", "inference")}
        assert any(words in text for text in said.values()), said
    pods.stop()


def _hub_snapshot(cache: Path, repo: str) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}, owned by the pods'
    uid as if a job of theirs had filled it."""
    org, name = repo.split("/")
    root = cache / "hub" / f"models--{org}--{name}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SNAPSHOT)
    snapshot = write_tiny_model(root / "snapshots" / SNAPSHOT, "llama")
    subprocess.run(["chown", "-R", "10001:10001", str(cache)], check=True)
    return snapshot


def _offline(manifest: dict) -> dict:
    """HF_HUB_OFFLINE=1 for the fetch (the init container): this cluster has no network, the cache is pre-filled."""
    for role in ("trainer", "inference", "actor"):
        manifest["spec"][role]["template"] = {
            "spec": {"containers": [{"name": role, "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}]}}
    return manifest


def test_an_hf_model_runs_offline_from_a_prefilled_cache_claim_and_a_missing_one_fails_naming_it(jobs, real_api,
                                                                                                    real_node):
    """Two jobs at once on one cache claim: hf://org/tiny, whose snapshot the test put there, Succeeds with each
    init container saying where it found it; hf://org/missing fails naming spec.model.path."""
    job, missing = jobs(2)
    cache = hostpath_claim(client.CoreV1Api(real_api), real_node, job.namespace, "hub-cache")
    _hub_snapshot(cache, "org/tiny")
    name = f"hf-offline-{uuid.uuid4().hex[:4]}"
    init_logs = {role: ContainerRuns(job.namespace, names.pod_name(name, role), names.INIT_MODEL)
                 for role in ("trainer", "inference", "actor")}
    for runs in init_logs.values():
        runs.start()
    job.apply(_offline(_on_this_node(**{
        "metadata.name": name, "spec.model.path": "hf://org/tiny", "spec.model.cacheClaimName": "hub-cache",
        "spec.algorithm.maxSteps": 2, "spec.trainer.checkpoint.intervalSteps": 2})))
    missing.apply(_offline(_on_this_node(**{
        "metadata.name": f"hf-missing-{uuid.uuid4().hex[:4]}", "spec.model.path": "hf://org/missing",
        "spec.model.cacheClaimName": "hub-cache"})))
    assert_failed_naming(missing, "spec.model.path",
                         "hf://org/missing: HF_HUB_OFFLINE is set and no complete snapshot")
    tj = job.wait_phase(("Succeeded", "Failed"), 300)
    assert tj["status"]["phase"] == "Succeeded", job.diagnostics()
    snapshot = f"{names.MODEL_CACHE_MOUNT}/hub/models--org--tiny/snapshots/{SNAPSHOT}"
    for role, runs in init_logs.items():
        runs.stop()
        assert f"model hf://org/tiny ready at {snapshot}" in runs.text, runs.describe()
    # Nothing was downloaded or written beside the snapshot the test put there.
    assert sorted(p.name for p in (cache / "hub").iterdir()) == ["models--org--tiny"]
