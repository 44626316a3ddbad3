"""examples/tiny-cpu.yaml with `spec.trainer.backend: megatron`, 2 trainer nodes and tensor parallel 2, run by
`rlkube local` (megatron tier): the two trainer processes split every layer of the model (data parallel 1), rank 1
trains the documents rank 0 reads, the job learns the built-in task, finishes, and tears down in order."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.local_cli import run_local
import yaml
from support.megatron_tier import megatron_core  # noqa: F401  (autouse: fails the tier without megatron-core)
from rlkube.core.training import checkpoint as ckpt
from support import specs

pytestmark = pytest.mark.megatron

MIN_MARGIN = 0.10  # as test_megatron_local_job.py (one rank) and the torch backend's test of the same job


def test_tiny_job_with_megatron_tensor_parallel_2_on_two_nodes_learns(tmp_path):
    job = specs.document(**{"metadata.name": "tiny-megatron-tp2", "spec.trainer.backend": "megatron",
                            "spec.trainer.nodes": 2, "spec.trainer.megatron": {"tensorParallel": 2}})
    manifest = tmp_path / "tiny-megatron-tp2.yaml"
    manifest.write_text(yaml.safe_dump(job))
    out = tmp_path / "run"
    t0 = time.monotonic()
    summary, _ = run_local(manifest, out, timeout=900)
    print(f"40 steps, megatron TP 2 on 2 trainer nodes: {time.monotonic() - t0:.1f}s")
    print(json.dumps(summary))
    assert summary["phase"] == "Succeeded" and summary["steps"] == 40
    assert summary["teardown"] == ["actor", "preprocessor", "inference", "trainer", "redis"]
    assert summary["reward_last"] - summary["reward_first"] >= MIN_MARGIN, summary
    assert summary["reward_last"] >= 2 * summary["reward_first"], summary
    meta = ckpt.read_meta(Path(summary["checkpoint"]))
    assert meta.step == 40 and meta.extra == {"backend": "megatron"}
    logs = {rank: (out / "logs" / f"trainer-{rank}.log").read_text() for rank in (0, 1)}
    # A restarted rank appends its new run to the same log: the restarts and the first traceback say why.
    assert not any(summary["restarts"].values()), (summary["restarts"], {r: traceback_in(t) for r, t in logs.items()})
    for rank, text in logs.items():
        assert "Traceback" not in text, traceback_in(text)
        assert f"tensor parallel 2 x data parallel 1; this rank is tensor rank {rank} of data rank 0" in text, \
            text[-3000:]
    assert "rank 1 left the data-parallel group after rank 0 finished" in logs[1], logs[1][-3000:]


def traceback_in(text: str) -> str:
    """The first traceback of a log and what follows it (the whole tail when there is none)."""
    at = text.find("Traceback")
    return text[max(0, at - 300):at + 3000] if at >= 0 else text[-3000:]
