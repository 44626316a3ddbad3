"""Rollout samples and the run report on a real `rlkube local` run (docs/design.md §5.7): the calculator example
(examples/calculator-cpu.yaml, multi-turn with a tool) for 30 steps with evaluation, its samples kept every 10 steps;
`rlkube samples` prints the step-30 samples (table and JSON), and `rlkube report` writes one HTML file that headless
Chromium (Debian's package, driven over the DevTools protocol) opens with no console error, its curves drawn and
its sample table filled; a second run overlays the first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support.headless_chromium import Chromium, chromium
from rlkube.contract import samples as contract
from support import ROOT

EXAMPLE = ROOT / "examples" / "calculator-cpu.yaml"
STEPS, EVERY, PER_STEP, EVAL_EVERY = 30, 10, 4, 10


def rlkube(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlkube.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160"})


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("samples")
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["algorithm"]["maxSteps"] = STEPS
    doc["spec"]["evaluation"] = {"everyVersions": EVAL_EVERY, "prompts": 8}
    doc["spec"]["samples"] = {"everySteps": EVERY, "perStep": PER_STEP}
    manifest = work / "calculator.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = work / "run"
    proc = rlkube("local", str(manifest), "--json", "--output-dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_trainer_keeps_every_tenth_steps_samples_with_turns_rewards_and_versions(run):
    rows = list(contract.read_rows(run / contract.FILE))
    train = [r for r in rows if r["kind"] == contract.TRAIN]
    assert sorted({r["step"] for r in train}) == [10, 20, 30]
    assert all(sum(r["step"] == s for r in train) == PER_STEP for s in (10, 20, 30))
    for r in train:
        # What the preprocessor's record carried (the document cannot): the group and why the episode ended.
        assert r["group"].startswith("actor-0-") and r["finish_reason"] in contract.FINISH_REASONS, r
        assert r["prompt"].endswith("=") and r["completion"], r
        assert 0 <= r["lag"] <= 2 and r["weight_version"] + r["lag"] == r["version"] == r["step"] - 1, r
        assert "".join(t["text"] for t in r["turns"]) == r["completion"] or len(r["turns"]) > 1
        assert sum(t["tokens"] for t in r["turns"]) == r["tokens"]["completion"]
        assert all(t["masked"] == (t["role"] == "environment") for t in r["turns"])
        assert isinstance(r["reward"], float) and isinstance(r["advantage"], float)
    # Episodes with a tool call: the environment's answer is a masked turn between two model turns.
    multi = [r for r in train if r.get("episode", {}).get("tool_calls")]
    assert multi, train
    assert all([t["role"] for t in r["turns"]][:3] == ["model", "environment", "model"] for r in multi)
    evaluation = [r for r in rows if r["kind"] == contract.EVALUATION]
    assert {r["version"] for r in evaluation} >= {0, 10, 20}, sorted({r["version"] for r in evaluation})
    # Only reported versions (the rows follow the event); the final one's only if it was scored before the trainer
    # exited (docs/design.md §5.7).
    reported = {e["version"] for e in contract.read_rows(run / "evaluation.jsonl")}
    assert {r["version"] for r in evaluation} <= reported
    for r in evaluation:
        assert r["weight_version"] >= r["version"] and r["finish_reason"] in contract.FINISH_REASONS, r
    # The same eval prompts at every version: what the report's diff view compares.
    prompts = {v: {r["prompt"] for r in evaluation if r["version"] == v} for v in (0, 10)}
    assert prompts[0] and prompts[0] == prompts[10]


def test_rlkube_samples_prints_the_step_30_samples_as_json_and_as_a_table(run):
    proc = rlkube("samples", str(run), "--step", "30", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["step"] for r in rows} == {30}
    assert sum(r["kind"] == contract.TRAIN for r in rows) == PER_STEP
    high = json.loads(rlkube("samples", str(run), "--step", "30", "--min-reward", "0.2", "--json").stdout)
    assert all(r["reward"] >= 0.2 for r in high) and len(high) == sum(r["reward"] >= 0.2 for r in rows)
    proc = rlkube("samples", str(run), "--step", "30", "--kind", "train", "--width", "160")
    assert proc.returncode == 0, proc.stderr
    table_rows = [line for line in proc.stdout.splitlines() if line.startswith("│ train ")]
    assert len(table_rows) == PER_STEP and all(" 30 " in line for line in table_rows), proc.stdout
    if any(len(r["turns"]) > 1 for r in rows if r["kind"] == contract.TRAIN):
        assert "[env] " in proc.stdout and "[model] " in proc.stdout, proc.stdout
    missing = rlkube("samples", str(run / "nope"))
    assert missing.returncode == 2 and "no such run" in missing.stderr


REPORT_CHECKS = {
    # every chart line with at least two points, and which charts there are
    "paths": "[...document.querySelectorAll('path.series')].filter(p => (p.getAttribute('d').match(/L/g) || [])"
             ".length >= 1).length",
    "titles": "[...document.querySelectorAll('svg.chart')].map(s => s.getAttribute('aria-label'))",
    "rows": "document.querySelectorAll('#sample-rows tr').length",
    "environment_turns": "document.querySelectorAll('#sample-rows .turn.environment').length",
    "diff": "document.getElementById('diff').innerHTML",
    "ready": "document.body.dataset.ready",
    "requests": "performance.getEntriesByType('resource').length",
}


def _colour_pixels(png: bytes, rgb: tuple[int, int, int]) -> int:
    """Pixels of (about) one colour in a PNG: a drawn chart line has many, an empty chart none."""
    import io

    import numpy as np
    from PIL import Image

    img = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
    return int((np.abs(img - np.array(rgb)).sum(axis=2) < 40).sum())


@pytest.mark.skipif(chromium() is None, reason="Debian's chromium is not installed (make deps-apt installs it)")
def test_the_report_opens_in_headless_chromium_with_its_curves_and_samples(run, tmp_path):
    html = tmp_path / "report.html"
    proc = rlkube("report", str(run), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    text = html.read_text()
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text
    with Chromium() as browser:
        page = browser.open(html, REPORT_CHECKS)
    v = page.values
    assert page.errors == [], page.errors
    assert v["ready"] == "1" and v["requests"] == 0, v  # the script ran; the page loaded nothing
    assert {"Reward", "Loss", "KL", "Entropy", "Lag", "Throughput", "Turns and tool calls",
            "Agent counters (whole run)"} <= set(v["titles"]), v["titles"]
    assert v["paths"] >= 12, v
    rows = list(contract.read_rows(run / contract.FILE))
    assert v["rows"] == len(rows) and v["environment_turns"] > 0, v
    assert "<ins>" in v["diff"] or "<del>" in v["diff"] or v["diff"], v["diff"]
    # The screenshot: the curves are drawn (the first series' blue), the sample table's rows are there (the model
    # turns' light blue background).
    assert _colour_pixels(page.screenshot, (0x1f, 0x77, 0xb4)) > 2000
    assert _colour_pixels(page.screenshot, (0xee, 0xf5, 0xff)) > 2000
    shot = os.environ.get("RLKUBE_REPORT_SCREENSHOT")
    if shot:  # docs/images/report-calculator.png is made this way (docs/guide/samples-and-reports.md)
        Path(shot).write_bytes(page.screenshot)


@pytest.mark.skipif(chromium() is None, reason="Debian's chromium is not installed (make deps-apt installs it)")
def test_two_runs_overlay_in_one_report(run, tmp_path):
    html = tmp_path / "both.html"
    other = tmp_path / "other"
    other.mkdir()
    # The second run: the same run's files under another name (the overlay draws one line per run and chart).
    for name in ("metrics.jsonl", "evaluation.jsonl", contract.FILE):
        (other / name).write_bytes((run / name).read_bytes())
    proc = rlkube("report", str(run), str(other), "-o", str(html))
    assert proc.returncode == 0, proc.stderr
    with Chromium() as browser:
        page = browser.open(html, {**REPORT_CHECKS, "runs": "[...document.querySelectorAll('#f-run option')]"
                                                           ".map(o => o.value)"})
    assert page.errors == [], page.errors
    single = len(list(contract.read_rows(run / contract.FILE)))
    assert page.values["rows"] == 2 * single and page.values["runs"] == ["", "calculator-cpu", "other"], page.values
    assert page.values["paths"] >= 24
    assert _colour_pixels(page.screenshot, (0xd6, 0x27, 0x28)) > 1000  # the second run's colour
