"""Which weights sampled which tokens of a vLLM request (rlkube.core.inference.vllm_engine: `_Versions`, and the
engine's attribution of a worker's progress report at an update), without vLLM: the report is our worker extension's own
format (rlkube.core.inference.vllm_worker._rlkube_progress), built here by hand."""

from __future__ import annotations

import pytest
from rlkube.core.inference.openai_api import version_spans
from rlkube.core.inference.sampling import Completion
from rlkube.core.inference.vllm_engine import VllmEngine, _Versions

pytestmark = pytest.mark.unit

KEY = "cmpl-" + "ab" * 16


def engine_with(n: int, version: int = 0) -> tuple[VllmEngine, _Versions]:
    engine = VllmEngine(llm=None, served=None, loop=None)
    engine.version = version
    versions = _Versions([[[0, version]] for _ in range(n)], [False] * n)
    engine._running[KEY] = versions
    return engine, versions


def test_each_choice_is_attributed_by_where_the_update_found_it():
    engine, versions = engine_with(4)
    # vLLM's child ids: "<index>_<request id>-<suffix>"; choice 3 was not scheduled yet at the switch.
    engine._attribute(1, {"running": {f"0_{KEY}-1a2b": 5, f"1_{KEY}-1a2b": 0}, "finished": [f"2_{KEY}-1a2b"]})
    assert versions.spans == [[[0, 0], [5, 1]], [[0, 1]], [[0, 0]], [[0, 1]]]
    assert versions.settled == [False, False, True, False]
    # A later update leaves the finished choice alone and cuts the running one again.
    engine._attribute(2, {"running": {f"0_{KEY}-1a2b": 9}, "finished": [f"1_{KEY}-1a2b", f"3_{KEY}-1a2b"]})
    assert versions.spans == [[[0, 0], [5, 1], [9, 2]], [[0, 1]], [[0, 0]], [[0, 1]]]


def test_a_choice_of_another_version_than_the_result_keeps_its_single_span():
    versions = _Versions([[[0, 0], [5, 1]], [[0, 1]], [[0, 0]]], [False, False, True])
    version, reported = versions.reported()
    assert version == 0
    assert reported == [[[0, 0], [5, 1]], [[0, 1]], None]
    # What the client reads: the all-version-1 choice is not reported as the result's version 0.
    spans = [version_spans(Completion(token_ids=[1], logprobs=[0.0], versions=r), version) for r in reported]
    assert spans == [[[0, 0], [5, 1]], [[0, 1]], [[0, 0]]]


def test_a_result_of_one_version_reports_no_spans():
    assert _Versions([[[0, 3]], [[0, 3]]], [False, False]).reported() == (3, [None, None])
