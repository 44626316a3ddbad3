"""The native engine's batched sampling on the real tiny HF model (no server): padding + KV cache, seeds, stops,
versions."""

from __future__ import annotations

import copy

import pytest
import torch
from support.hf_models import builtin_dir
from rlkube.core.hf.loading import load_model, load_tokenizer
from rlkube.core.training.losses import token_logprobs
from rlkube.core.inference.sampling import EngineStopped, GenerationRequest, SamplingEngine

TOK = load_tokenizer(builtin_dir(3))


@pytest.fixture(scope="module")
def model():
    return load_model(builtin_dir(3))


def req(prompt: str, **kw) -> GenerationRequest:
    return GenerationRequest(prompt_ids=TOK.encode(prompt), **{"n": 4, "max_tokens": 6, "seed": 5, **kw})


def test_rows_of_different_lengths_in_one_batch_match_separate_batches(model):
    engine = SamplingEngine(model, TOK)
    short, long = req("1:", seed=1), req("98765:", seed=2)
    together = engine.generate([short, long])
    apart = [engine.generate([short])[0], engine.generate([long])[0]]
    for a, b in zip(together, apart, strict=True):
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert ca.token_ids == cb.token_ids
            assert ca.logprobs == pytest.approx(cb.logprobs, abs=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_are_those_of_the_sampled_distribution(model, temperature):
    engine = SamplingEngine(model, TOK)
    r = req("123:", temperature=temperature, max_tokens=5)
    result = engine.generate([r])[0]
    for c in result.completions:
        tokens = torch.tensor([r.prompt_ids + c.token_ids])
        with torch.no_grad():
            expected = token_logprobs(model(tokens).logits, tokens, temperature or 1.0)[0, len(r.prompt_ids) - 1:]
        assert c.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    if temperature == 0:  # greedy: every row the same
        assert len({tuple(c.token_ids) for c in result.completions}) == 1


def test_same_seed_same_samples_other_seed_other_samples(model):
    engine = SamplingEngine(model, TOK)
    a = engine.generate([req("42:", seed=9)])[0].completions
    b = engine.generate([req("42:", seed=9)])[0].completions
    c = engine.generate([req("42:", seed=10, n=16)])[0].completions
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert {tuple(x.token_ids) for x in c} != {tuple(x.token_ids) for x in a}


class Ones(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(x)


def test_eos_and_stop_strings_end_a_row(model):
    # A model whose head always prefers one token makes the outcome certain: the final norm outputs ones, and only
    # that token's row of the LM head is non-zero.
    def forced(token: int) -> torch.nn.Module:
        m = copy.deepcopy(model)
        m.model.norm = Ones()
        with torch.no_grad():
            m.lm_head.weight.zero_()
            m.lm_head.weight[token] = 1.0
        return m

    eos = SamplingEngine(forced(TOK.eos_id), TOK).generate([req("1:", temperature=0)])[0]
    for c in eos.completions:
        assert c.token_ids == [TOK.eos_id] and c.finish_reason == "stop" and c.text == ""

    seven = TOK.hf.convert_tokens_to_ids("7")
    out = SamplingEngine(forced(seven), TOK).generate(
        [req("1:", temperature=0, stop=("77",)), req("1:", temperature=0, max_tokens=3)])
    stopped, capped = out[0].completions[0], out[1].completions[0]
    assert stopped.finish_reason == "stop" and stopped.text == "" and stopped.token_ids == [seven, seven]
    assert capped.finish_reason == "length" and capped.text == "777" and len(capped.token_ids) == 3


def test_a_request_waits_for_its_min_version_without_blocking_others(model):
    engine = SamplingEngine(model, TOK, version=0).start()
    try:
        waiting = engine.submit(req("1:", min_version=1))
        other = engine.submit(req("2:"))
        assert other.result(timeout=30).version == 0  # served while the first one waits
        assert not waiting.done()
        engine.set_policy(copy.deepcopy(model), 1)
        assert waiting.result(timeout=30).version == 1
    finally:
        engine.stop()


def test_swapping_the_policy_changes_the_version_and_the_output(model):
    engine = SamplingEngine(model, TOK, version=0)
    before = engine.generate([req("5:", temperature=0)])[0]
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.set_policy(other, 7)
    after = engine.generate([req("5:", temperature=0)])[0]
    assert (before.version, after.version) == (0, 7)
    assert before.completions[0].logprobs != pytest.approx(after.completions[0].logprobs, abs=1e-3)


def test_versions_going_back_release_waiting_requests(model):
    # A restarted trainer resumes at its checkpoint's version: requests waiting for a version of the dead run
    # must not wait for it.
    engine = SamplingEngine(model, TOK, version=6).start()
    try:
        waiting = engine.submit(req("1:", min_version=7))
        assert engine.submit(req("2:")).result(timeout=30).version == 6
        assert not waiting.done()
        engine.set_policy(copy.deepcopy(model), 5)
        assert waiting.result(timeout=30).version == 5
    finally:
        engine.stop()


def test_shutdown_refuses_waiting_and_new_requests_at_once(model):
    # A server stopping must not hold a request for MIN_VERSION_WAIT_S (its graceful shutdown would wait for it).
    engine = SamplingEngine(model, TOK, version=0).start()
    waiting = engine.submit(req("1:", min_version=3))
    assert engine.submit(req("2:")).result(timeout=30).version == 0  # the worker is running and idle again
    assert not waiting.done()
    assert engine.stop(timeout=30)
    with pytest.raises(EngineStopped):
        waiting.result(timeout=0)
    with pytest.raises(EngineStopped):
        engine.submit(req("3:")).result(timeout=0)


def test_kv_cache_generation_matches_a_full_recompute(model):
    # Every sampled token's log-prob equals one full forward pass over prompt + completion (no cache, no padding),
    # for rows whose prompts had different lengths (left padding) in one batch.
    engine = SamplingEngine(model, TOK)
    reqs = [req("7:", n=3, max_tokens=8, seed=4), req("123456:", n=2, max_tokens=8, seed=5)]
    for r, result in zip(reqs, engine.generate(reqs), strict=True):
        for c in result.completions:
            tokens = torch.tensor([r.prompt_ids + c.token_ids])
            with torch.no_grad():
                full = token_logprobs(model(tokens).logits, tokens)[0, len(r.prompt_ids) - 1:]
            assert c.logprobs == pytest.approx(full.tolist(), abs=1e-5)
