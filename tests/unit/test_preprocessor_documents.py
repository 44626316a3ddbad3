"""Rollout group -> Fast-LLM documents (pure): layout, masking, advantages, partial and singleton groups."""

import numpy as np
import pytest

from rlkube.contract import protocol
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents


def group(rewards, expected=4, version=3, completions=None):
    completions = completions or [[20 + i, 2] for i in range(len(rewards))]
    samples = [protocol.Sample(c, [-0.5 * (j + 1) for j in range(len(c))], r) for c, r in zip(completions, rewards, strict=True)]
    return protocol.RolloutGroup("g", [1, 5, 6, 16], samples, model_version=version, expected_size=expected)


def test_document_layout_in_fast_llm_format():
    docs = group_to_documents(group([1.0, 0.0, 0.0, 1.0]), DocumentConfig())
    assert len(docs) == 4
    d = protocol.decode_document(protocol.encode_document(docs[0]))  # survives the wire
    assert d.tokens.tolist() == [1, 5, 6, 16, 20, 2]  # prompt + completion
    assert d.loss_masking_spans == [(0, 4)]  # the prompt is EXCLUDED
    assert d.loss_mask().tolist() == [False] * 4 + [True, True]
    assert d.old_log_probabilities.tolist() == [0, 0, 0, 0, -0.5, -1.0]
    assert d.model_version.tolist() == [3] * 6
    assert d.reward == 1.0
    assert [x.advantage for x in docs] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_mean_std_estimator_and_normalisation():
    docs = group_to_documents(group([1.0, 0.0, 0.0, 1.0]), DocumentConfig(estimator="mean-std"))
    assert [d.advantage for d in docs] == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001])


def test_partial_group_uses_what_it_has():
    docs = group_to_documents(group([0.2, 0.8], expected=8), DocumentConfig())
    assert [d.advantage for d in docs] == pytest.approx([-0.6, 0.6])


def test_singleton_group_is_dropped_except_for_sft():
    assert group_to_documents(group([1.0], expected=8), DocumentConfig()) == []
    kept = group_to_documents(group([1.0], expected=8), DocumentConfig(drop_singletons=False))
    assert len(kept) == 1 and kept[0].advantage == 0.0


def test_bad_samples_are_dropped_and_the_rest_compared():
    g = group([1.0, 0.0, 0.5], completions=[[20, 2], [21, 2], list(range(3, 40))])
    g.samples.append(protocol.Sample([], [], 0.3))  # empty completion
    g.samples.append(protocol.Sample([22, 2], [-1.0], 0.9))  # log-prob count mismatch
    docs = group_to_documents(g, DocumentConfig(max_length=16))  # the 37-token sample is too long
    assert [d.reward for d in docs] == [1.0, 0.0]
    assert [d.advantage for d in docs] == pytest.approx([1.0, -1.0])
    assert all(len(d.tokens) <= 16 for d in docs)
    assert all(d.old_log_probabilities.dtype == np.float32 for d in docs)


def test_a_failed_reward_travels_from_the_rollout_to_the_document():
    g = group([0.0, 1.0, 0.0])
    g.samples[0].reward_error = True
    wire = protocol.RolloutGroup.decode(g.encode())  # actor -> preprocessor
    assert [s.reward_error for s in wire.samples] == [True, False, False]
    docs = group_to_documents(wire, DocumentConfig())
    fields = [protocol.encode_document(d) for d in docs]  # preprocessor -> trainer
    assert b"reward_error" in fields[0]["data"] and b"reward_error" not in fields[1]["data"]
    assert [protocol.decode_document(f).reward_error for f in fields] == [True, False, False]
    # rollouts and documents written before the flag existed decode as scored
    old = protocol.RolloutGroup.decode({"group": b'{"group_id": "g", "prompt_tokens": [1], "model_version": 0, '
                                                 b'"samples": [{"completion_tokens": [2], "logprobs": [-1.0], '
                                                 b'"reward": 1.0, "finished": true}]}'})
    assert old.samples[0].reward_error is False
