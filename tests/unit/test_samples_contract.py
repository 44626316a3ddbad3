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
    from pod_security import assert_hardened_pod
    from rlkube.runs.kube import reader_pod

    owner = {"metadata": {"name": "job", "uid": "u-1"}}
    pod = reader_pod("job-samples-reader", "img:1", "ckpt", "/checkpoints", "/checkpoints/samples.jsonl", owner)
    assert_hardened_pod(pod, {})
    assert pod["spec"]["volumes"][0] == {"name": "checkpoints",
                                         "persistentVolumeClaim": {"claimName": "ckpt", "readOnly": True}}
    (container,) = pod["spec"]["containers"]
    assert container["volumeMounts"][0]["readOnly"] is True and container["command"][-1] == "/checkpoints/samples.jsonl"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1" and pod["spec"]["restartPolicy"] == "Never"
