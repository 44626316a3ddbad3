"""The documents a fast-llm job's preprocessor writes, against the schema Fast-LLM's streaming dataset enforces
(RedisStreamingDocumentData, recorded from Fast-LLM's source at the pinned commit in
tests/fixtures/fast_llm_config_fields.json, `document`, by tests/support/fast_llm_fields.py).

Fast-LLM turns every stream field but `data`, and every key of the `data` JSON, into a keyword of a strict
from_dict: a key it does not declare fails its data loader ("Unknown field"). `fast_llm_parse` below is that
parse over the recorded fields and types; every kind of document our preprocessor writes goes through it, taken
from a real Redis stream the real preprocessor role filled. The same section records that Fast-LLM reads a
token's model_version in documents-seen units, which the preprocessor writes for a Fast-LLM trainer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from rlkube.contract import protocol
from rlkube.contract.context import RoleContext
from rlkube.core.preprocessor import role as preprocessor_role
from rlkube.core.preprocessor.documents import DocumentConfig, group_to_documents
from rlkube.core.preprocessor.role import PreprocessorRole
from rlkube.lifecycle.validation import parse_spec
from support.fast_llm_fields import PROMPT, _sample, document_corpus, document_groups

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "fast_llm_config_fields.json").read_text())
SCHEMA = FIXTURE["document"]
TENSORS = {"tokens": "<i8", "old_log_probabilities": "<f4", "model_version": "<i8"}
"""Stream fields Fast-LLM reads as raw little-endian tensors, and their dtypes (the recorded torch.frombuffer lines)."""


def fast_llm_parse(message: dict) -> dict:
    """RedisStreamingDocumentData.from_message over the recorded schema: keywords as Fast-LLM builds them, each
    an error unless it is a recorded field of its recorded type; tensors one value per token."""
    kwargs: dict = {}
    for key, value in message.items():
        key = key.decode() if isinstance(key, bytes) else key
        if key == "data":
            kwargs.update(json.loads(value))
        else:
            kwargs[key] = value
    fields = SCHEMA["fields"]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ValueError(f"Unknown field {unknown} in class RedisStreamingDocumentData")
    missing = [name for name, f in fields.items() if f["required"] and name not in kwargs]
    if missing:
        raise ValueError(f"missing required {missing}")
    parsed = {}
    for name, value in kwargs.items():
        declared = fields[name]["type"]
        if declared.startswith("torch.Tensor"):
            if not isinstance(value, bytes):
                raise ValueError(f"{name}: {type(value).__name__}, not the bytes of a tensor")
            parsed[name] = np.frombuffer(value, dtype=TENSORS[name])
        elif declared.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}: {value!r} is not a float")
            parsed[name] = value
        elif declared.startswith("list[tuple[int, int]]"):
            if not (isinstance(value, list) and all(isinstance(s, list) and len(s) == 2
                                                    and all(type(x) is int for x in s) for s in value)):
                raise ValueError(f"{name}: {value!r} is not a list of (int, int)")
            parsed[name] = value
        else:
            raise ValueError(f"{name}: no check for {declared}")
    for name in ("old_log_probabilities", "model_version"):
        if name in parsed and len(parsed[name]) != len(parsed["tokens"]):
            raise ValueError(f"{name}: {len(parsed[name])} values for {len(parsed['tokens'])} tokens")
    return parsed


def test_the_record_is_fast_llms_document_class():
    assert SCHEMA["class"] == "fast_llm.data.dataset.streaming.RedisStreamingDocumentData"
    assert set(SCHEMA["fields"]) == set(protocol.FAST_LLM_DOCUMENT_FIELDS)
    assert not set(protocol.OUR_DOCUMENT_KEYS) & set(SCHEMA["fields"])
    assert "strict" in SCHEMA["evidence"]["strict_refuses_leftovers"]["source"]
    assert "documents-seen" in SCHEMA["evidence"]["model_version_units"]["source"]


def test_the_parse_refuses_what_fast_llm_refuses():
    doc = protocol.Document(np.arange(4, dtype=np.int64), [(0, 2)], 0.5, 1.0, reward_error=True)
    with pytest.raises(ValueError, match="Unknown field.*reward_error"):
        fast_llm_parse(protocol.encode_document(doc))  # our trainers' entry
    fields = protocol.encode_document(doc, ours=False)
    with pytest.raises(ValueError, match="Unknown field.*trace"):
        fast_llm_parse({**fields, "trace": b"x"})
    with pytest.raises(ValueError, match="not a float"):
        fast_llm_parse({**fields, "data": json.dumps({"advantage": "high"}).encode()})
    with pytest.raises(ValueError, match="values for 4 tokens"):
        fast_llm_parse({**fields, "model_version": np.zeros(3, dtype="<i8").tobytes()})


@pytest.fixture(autouse=True)
def _short_reads(monkeypatch):
    monkeypatch.setattr(preprocessor_role, "READ_BLOCK_MS", 10)
    monkeypatch.setattr(preprocessor_role, "HOLD_POLL_MS", 10)


def _groups() -> dict[str, protocol.RolloutGroup]:
    """One rollout group per kind of document an RL job writes: the corpus the recording tool ran Fast-LLM's own
    parser on (tests/support/fast_llm_fields.py, document_groups)."""
    return document_groups()


def test_every_document_a_fast_llm_job_writes_is_one_fast_llm_accepts(redis_server, redis_client):
    """The real preprocessor role of a fast-llm job, on real Redis: Fast-LLM's weights_ready events (documents
    seen, not steps: a step of 8 documents, then one of 9), then one group of each kind."""
    raw = copy.deepcopy(FIXTURE["samples"]["examples/fast-llm.yaml"]["spec"])  # the shipped fast-llm example
    raw["algorithm"].update(groupSize=2, samplesPerStep=8, filterZeroAdvantageGroups=False)
    spec = parse_spec(raw)
    assert spec.trainer.backend == "fast-llm"
    ctx = RoleContext("ns", "job", spec, redis_server.url)
    role = PreprocessorRole(ctx, redis_client, max_ahead=10_000)
    for step, seen in ((0, 0), (1, 8), (2, 17)):  # Fast-LLM's event: {"type", "step", "documents_seen"} only
        redis_client.xadd(ctx.keys.events, protocol.encode_event(protocol.WEIGHTS_READY, step=step,
                                                                 documents_seen=seen))
    groups = _groups()
    for g in groups.values():
        redis_client.xadd(ctx.keys.rollouts, g.encode())
    for _ in range(4):
        role.poll()
    entries = redis_client.xrange(ctx.keys.documents)
    assert len(entries) == 2 * len(groups)
    parsed = [fast_llm_parse(fields) for _, fields in entries]  # raises on anything Fast-LLM would refuse
    by_kind = dict(zip(groups, (parsed[i:i + 2] for i in range(0, len(parsed), 2)), strict=True))
    # model_version in documents-seen units: the documents_seen of the weights_ready that announced each version
    units = {0: 0, 1: 8, 2: 17}
    single = by_kind["single-turn"][0]
    assert single["model_version"].tolist() == [units[1]] * (len(PROMPT) + 2)
    episode = by_kind["multi-turn"][0]
    assert episode["model_version"].tolist() == [units[1]] * (len(PROMPT) + 5) + [units[2]] * 3
    assert episode["loss_masking_spans"] == [[0, 3], [5, 8]]
    assert by_kind["reward error"][0]["reward"] == 0.0  # scored 0, and no reward_error key
    assert by_kind["truncated"][0]["tokens"].tolist() == PROMPT + [20, 21, 22, 23]


def test_a_version_no_event_announced_is_counted_in_steps_of_documents():
    """Before the preprocessor has seen an event (or one without documents_seen), v x samplesPerStep, the
    actors' rule (rlkube.core.actor.lag.documents_seen_of)."""
    g = _groups()["multi-turn"]
    docs = group_to_documents(g, DocumentConfig(documents_per_version=6))
    assert docs[0].model_version.tolist() == [6] * 8 + [12] * 3
    assert group_to_documents(g, DocumentConfig())[0].model_version.tolist() == [1] * 8 + [2] * 3  # our trainers


def test_sft_rows_are_documents_fast_llm_accepts():
    """SFT rows (the reference completion as a group of one, advantage 0) go through the same encoder."""
    row = protocol.RolloutGroup("row", PROMPT, [_sample(5, 0.0)], model_version=0, expected_size=1)
    docs = group_to_documents(row, DocumentConfig(drop_singletons=False, documents_per_version=6))
    parsed = fast_llm_parse(protocol.encode_document(docs[0], ours=False))
    assert parsed["advantage"] == 0.0 and parsed["loss_masking_spans"] == [[0, 3]]


def test_our_trainers_keep_the_reward_error():
    doc = protocol.Document(np.arange(4, dtype=np.int64), [(0, 2)], reward_error=True)
    assert protocol.decode_document(protocol.encode_document(doc)).reward_error is True
    assert protocol.decode_document(protocol.encode_document(doc, ours=False)).reward_error is False


RECORDED = SCHEMA["fast_llm_parse"]["verdicts"]
NEGATIVE = "negative control: reward error as our trainers' entry"


def test_fast_llms_own_parser_accepted_every_kind_and_refused_the_control():
    kinds = {v["kind"] for v in RECORDED}
    assert kinds == set(_groups()) | {"sft row", NEGATIVE}
    assert all(v["accepted"] for v in RECORDED if v["kind"] != NEGATIVE), [v for v in RECORDED if not v["accepted"]]
    (control,) = [v for v in RECORDED if v["kind"] == NEGATIVE]
    assert not control["accepted"] and "Unknown field `reward_error`" in control["error"], control


def test_what_we_write_today_is_what_fast_llm_parsed():
    """Our preprocessor's corpus now (the tool's own writer: real preprocessor role, real redis-server), document
    by document against Fast-LLM's recorded parse of it: same stream fields, same data keys, same values."""
    corpus = document_corpus()
    assert [kind for kind, _ in corpus] == [v["kind"] for v in RECORDED]
    for (kind, message), recorded in zip(corpus, RECORDED, strict=True):
        assert sorted(k.decode() for k in message) == recorded["stream_fields"], kind
        if kind == NEGATIVE:
            with pytest.raises(ValueError, match="Unknown field"):
                fast_llm_parse(message)
            continue
        ours = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in fast_llm_parse(message).items()}
        theirs = {k: v for k, v in recorded["parsed"].items() if k != "tokens_dtype"}
        assert ours == theirs, (kind, ours, theirs)
