"""`rlkube report`'s HTML without a browser (rlkube.runs.report; the browser test is
tests/integration/local/test_samples_and_report.py): a chart per metric a run has, one line per run, nothing for what no
run has, and the page loading nothing from anywhere."""

from __future__ import annotations

import re

from rlkube.runs.report import Run, charts, render, svg_chart


def _run(name: str, keys: tuple[str, ...], steps: int = 5) -> Run:
    metrics = [{"step": s, **{k: float(s * (i + 1)) for i, k in enumerate(keys)}} for s in range(1, steps + 1)]
    return Run(name, metrics, [{"version": 0, "reward_mean": 0.1}, {"version": 5, "reward_mean": 0.4}],
               [{"kind": "evaluation", "step": 0, "version": 0, "prompt": "1+1=", "completion": "2", "reward": 1.0,
                 "weight_version": 0}])


def test_one_chart_per_metric_present_and_one_line_per_run():
    one = charts([_run("a", ("reward_mean", "loss"))])
    assert [re.search(r'aria-label="([^"]+)"', c).group(1) for c in one] == ["Reward", "Loss"]
    assert one[0].count('class="series"') == 2  # training reward and the eval reward
    two = charts([_run("a", ("reward_mean", "loss")), _run("b", ("reward_mean", "loss"))])
    assert [c.count('class="series"') for c in two] == [4, 2]
    assert svg_chart("empty", [("x", "#000", "", [])]) == ""


def test_a_path_goes_through_every_point_in_step_order():
    svg = svg_chart("t", [("x", "#000", "", [(3, 1.0), (1, 0.0), (2, 0.5)])], width=100, height=100)
    d = re.search(r' d="([^"]+)"', svg).group(1)
    xs = [float(p.split(",")[0]) for p in re.findall(r"[ML]([\d.]+,[\d.]+)", d)]
    assert len(xs) == 3 and xs == sorted(xs)


def test_the_page_is_self_contained_and_escapes_sample_text():
    run = _run("a", ("reward_mean",))
    run.samples[0]["completion"] = "</script><script>alert(1)</script>"
    page = render([run])
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert "</script><script>alert(1)" not in page  # the inline JSON cannot close its script element
    assert re.findall(r"https?://", page.replace("http://www.w3.org/2000/svg", "")) == []
