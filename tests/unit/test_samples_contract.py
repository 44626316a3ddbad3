"""The sample rows' contract (rlkube.contract.samples, docs/design.md §5.7): turns cut at the environment's spans, the
finish reasons, texts cut at maxTextChars, the append-only file that never passes its bound, and the readers'
filters (rlkube.runs.samples)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlkube.contract import samples
from rlkube.runs.samples import Filter, parse_steps


def decode(ids):
    return " ".join(str(i) for i in ids)


def test_turns_alternate_model_and_environment_and_mark_the_environment_masked():
    turns = samples.turns([1, 2, 3, 4, 5, 6, 7], [(2, 4), (6, 7)], decode)
    assert [(t["role"], t["text"], t["masked"]) for t in turns] == [
        ("model", "1 2", False), ("environment", "3 4", True), ("model", "5 6", False), ("environment", "7", True)]
    assert samples.turns([9, 8], None, decode) == [{"role": "model", "text": "9 8", "tokens": 2, "masked": False}]


@given(n=st.integers(0, 40), cuts=st.lists(st.integers(0, 40), max_size=8))
def test_turns_cover_every_token_once_in_order(n, cuts):
    points = sorted({min(c, n) for c in cuts})
    spans = [(points[i], points[i + 1]) for i in range(0, len(points) - 1, 2)]
    ids = list(range(n))
    turns = samples.turns(ids, spans, lambda x: ",".join(map(str, x)))
    assert sum(t["tokens"] for t in turns) == n
    rebuilt = [int(x) for t in turns for x in t["text"].split(",") if x != ""]
    assert rebuilt == ids
    masked = sum(t["tokens"] for t in turns if t["masked"])
    assert masked == sum(e - b for b, e in spans)


@pytest.mark.parametrize(("finished", "episode", "reason"), [
    (True, None, "stop"), (False, None, "length"), (True, {"truncated": 1}, "truncated"),
    (False, {"truncated": 1, "timed_out": 1}, "timeout"), (True, {"truncated": 0, "timed_out": 0}, "stop")])
def test_finish_reasons(finished, episode, reason):
    assert samples.finish_reason(finished, episode) == reason


def test_clip_cuts_every_text_and_says_so():
    row = {"prompt": "p" * 50, "completion": "c" * 10, "turns": [{"role": "model", "text": "t" * 30}]}
    out = samples.clip(row, 20)
    assert (len(out["prompt"]), len(out["completion"]), len(out["turns"][0]["text"])) == (20, 10, 20)
    assert out["truncated"] is True
    assert "truncated" not in samples.clip({"prompt": "short"}, 20)


def test_the_file_is_only_appended_to_and_never_passes_its_bound(tmp_path):
    log = samples.BoundedLog(tmp_path / "s" / samples.FILE, max_bytes=300)
    rows = [{"kind": "train", "step": i, "prompt": "x" * 40} for i in range(10)]
    written = log.append(rows[:3])
    first = log.path.read_bytes()
    written += log.append(rows[3:])
    data = log.path.read_bytes()
    assert data.startswith(first) and len(data) <= 300
    assert written == len(data.splitlines()) and log.dropped == 10 - written and 0 < written < 10
    assert [r["step"] for r in samples.read_rows(log.path)] == list(range(written))


def test_a_line_cut_by_a_crash_is_skipped(tmp_path):
    path = tmp_path / samples.FILE
    path.write_text(json.dumps({"kind": "evaluation", "version": 10}) + "\n" + '{"kind": "tra')
    assert [r["version"] for r in samples.read_rows(path)] == [10]
    assert samples.evaluated_versions(path) == {10}


def test_a_run_counts_and_reads_only_its_own_rows_on_a_shared_file(tmp_path):
    """A claim reused by a new job: the earlier job's rows are not the new job's kept steps, and the readers (a run
    directory through its job.json's uid, a job through its uid) show the new job's rows only."""
    from rlkube.contract import runtime
    from rlkube.runs.samples import local_rows, rows_of

    log = samples.BoundedLog(tmp_path / samples.FILE, max_bytes=1 << 20)
    log.append([{"kind": "train", "step": 30, "run": "old"},
                {"kind": "evaluation", "version": 30, "step": 30, "run": "old"},
                {"kind": "train", "step": 10, "run": "new"}, {"kind": "train", "step": 20}])
    assert samples.kept_steps(log.path, "new") == {10} and samples.kept_steps(log.path, "old") == {30}
    assert samples.kept_steps(log.path) == {20}  # a keeper that knows no run: the rows that name none
    assert samples.evaluated_versions(log.path, "new") == set()
    assert len(rows_of(str(tmp_path))) == 4  # no job.json: the reader cannot tell runs apart
    runtime.write_job_config(tmp_path / "job.json", "ns", "job", {}, uid="new")
    assert [r["step"] for r in rows_of(str(tmp_path))] == [10] == [r["step"] for r in local_rows(tmp_path)]
    assert [r["step"] for r in samples.of_run(samples.read_rows(log.path), "old")] == [30, 30]


def test_text_read_through_the_api_server_is_cut_into_rows_at_newlines_only(tmp_path):
    """A model's text may hold U+2028 or U+0085, which JSON keeps as they are (ensure_ascii off) and str.splitlines
    cuts at: every row comes back whole."""
    log = samples.BoundedLog(tmp_path / samples.FILE, max_bytes=1 << 20)
    rows = [{"kind": "train", "step": 30, "completion": f"a{sep}b"} for sep in ("\u2028", "\x85", "\x0c", "")]
    log.append(rows)
    text = log.path.read_text(encoding="utf-8")
    assert list(samples.parse_text(text)) == rows == list(samples.read_rows(log.path))
    assert len(list(samples.parse_rows(text.splitlines()))) < len(rows)  # what splitlines did


def test_filters_by_step_kind_and_reward():
    rows = [{"kind": k, "step": s, "reward": r} for k in ("train", "evaluation") for s in (10, 20, 30)
            for r in (0.0, 1.0)]
    assert {r["step"] for r in Filter(parse_steps(["30"]))(rows)} == {30}
    assert {r["step"] for r in Filter(parse_steps(["15:30"]))(rows)} == {20, 30}
    assert {r["step"] for r in Filter(parse_steps(["20:"]))(rows)} == {20, 30}
    assert {r["kind"] for r in Filter(kind="evaluation")(rows)} == {"evaluation"}
    assert {r["reward"] for r in Filter(min_reward=0.5)(rows)} == {1.0}
    assert {r["reward"] for r in Filter(max_reward=0.5)(rows)} == {0.0}
    assert {r["step"] for r in Filter(last=1)(rows)} == {30}
    with pytest.raises(ValueError, match="--step 'x'"):
        parse_steps(["x"])


def test_the_claim_reader_pod_is_hardened_read_only_and_owned_by_the_job():
    from support.pod_security import assert_hardened_pod
    from rlkube.runs.kube import reader_pod

    owner = {"metadata": {"name": "job", "uid": "u-1"}}
    pod = reader_pod("job-samples-reader", "img:1", "ckpt", "/checkpoints", "/checkpoints/samples.jsonl", owner)
    assert_hardened_pod(pod, {})
    assert pod["spec"]["volumes"][0] == {"name": "checkpoints",
                                         "persistentVolumeClaim": {"claimName": "ckpt", "readOnly": True}}
    (container,) = pod["spec"]["containers"]
    assert container["volumeMounts"][0]["readOnly"] is True and container["command"][-1] == "/checkpoints/samples.jsonl"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1" and pod["spec"]["restartPolicy"] == "Never"


def test_an_exec_reply_is_cut_into_its_channels_and_its_exit_code():
    """pods/exec frames (channel byte, data): stdout joined before decoding (a frame may end inside a UTF-8
    character), stderr apart, the exit code from the error channel's status."""
    from rlkube.runs.kube import exec_result

    row = '{"kind": "train", "step": 30, "completion": "é"}\n'.encode()
    cut = row.index(b"\xc3") + 1
    ok = exec_result([b"\x01", b"\x02", b"\x03", b"\x01" + row[:cut], b"\x02warning\n", b"\x01" + row[cut:],
                      b'\x03{"metadata": {}, "status": "Success"}'])
    assert (ok.stdout, ok.stderr, ok.code) == (row.decode(), "warning\n", 0)
    assert list(samples.parse_text(ok.stdout)) == [json.loads(row)]
    status = {"status": "Failure", "reason": "NonZeroExitCode",
              "details": {"causes": [{"reason": "ExitCode", "message": "1"}]}}
    failed = exec_result([b"\x02Traceback (most recent call last):\nFileNotFoundError: x\n",
                          b"\x03" + json.dumps(status).encode()])
    assert failed.code == 1 and "FileNotFoundError" in failed.stderr and failed.stdout == ""
    assert exec_result([]).code == 1  # nothing at all came back: not an empty file


def _pod(phase: str, running: bool):
    from types import SimpleNamespace as NS

    return NS(status=NS(phase=phase, container_statuses=[NS(name="trainer", state=NS(running=running or None))]))


class _RefusingExec:
    """kubernetes_asyncio's WsApiClient and CoreV1Api as they behave when the API server refuses an exec's upgrade
    (the trainer container ended between the pod read and the exec): the handshake fails with HTTP 500."""

    calls = 0

    def __init__(self, *args):
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def connect_get_namespaced_pod_exec(self, *args, **kwargs):
        from aiohttp import WSServerHandshakeError

        type(self).calls += 1
        raise WSServerHandshakeError(None, (), status=500, message="Invalid response status")


class _Core:
    def __init__(self, *pods):
        self.pods = list(pods)

    async def read_namespaced_pod(self, name, namespace):
        return self.pods.pop(0) if len(self.pods) > 1 else self.pods[0]


@pytest.fixture
def refusing_exec(monkeypatch):
    import kubernetes_asyncio.client
    import kubernetes_asyncio.stream

    _RefusingExec.calls = 0
    monkeypatch.setattr(kubernetes_asyncio.stream, "WsApiClient", _RefusingExec)
    monkeypatch.setattr(kubernetes_asyncio.client, "CoreV1Api", _RefusingExec)
    return _RefusingExec


def test_an_exec_refused_because_the_trainer_just_ended_falls_back_to_the_claim(refusing_exec, monkeypatch):
    import asyncio

    from rlkube.runs import kube

    async def no_wait(_):
        return None

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    # Still shown running once after the refusal (the kubelet's status lags), then ended: None, the claim is read.
    core = _Core(_pod("Running", True), _pod("Succeeded", False))
    assert asyncio.run(kube._exec_read(None, core, "ns", "job-trainer-0", "/checkpoints/samples.jsonl")) is None
    assert refusing_exec.calls == 2


def test_an_exec_refused_while_the_trainer_runs_on_is_an_error_naming_the_pod(refusing_exec, monkeypatch):
    import asyncio

    from rlkube.runs import kube

    monkeypatch.setattr(kube, "EXEC_REFUSED_S", 0.0)
    with pytest.raises(kube.JobFilesError, match=r"ns/job-trainer-0: the API server refused the exec \(HTTP 500"):
        asyncio.run(kube._exec_read(None, _Core(_pod("Running", True)), "ns", "job-trainer-0", "/c/samples.jsonl"))
