"""`rlkube local` on a colocated job (examples/colocated-cpu.yaml, docs/guide/colocated.md): the trainer's process
is the supervisor that runs the trainer and the native engine side by side; the job learns and Succeeds, the
engine joined the weight-update group from inside the trainer's process."""

from __future__ import annotations

import json

import pytest
from support.local_cli import run_local
from support import ROOT

pytestmark = pytest.mark.integration

EXAMPLE = ROOT / "examples" / "colocated-cpu.yaml"


def test_a_colocated_job_succeeds_through_rlkube_local(tmp_path):
    out = tmp_path / "run"
    summary, _ = run_local(EXAMPLE, out, timeout=600)
    print(json.dumps(summary))
    assert (summary["phase"], summary["steps"]) == ("Succeeded", 40)
    # No inference process of its own: the trainer's stage stops it.
    assert summary["teardown"] == ["actor", "preprocessor", "trainer", "redis"]
    assert summary["reward_last"] - summary["reward_first"] >= 0.10, summary
    logs = out / "logs"
    assert not (logs / "inference-0.log").exists()
    log = (logs / "trainer-0.log").read_text()
    assert "started the trainer and its colocated engine" in log
    assert "[inference] " in log and "joining weight-update epoch" in log and "[trainer] " in log
    assert "trainer exited 0" in log
