"""Request checks and response shapes of the native server's OpenAI completions API (pure functions)."""

from __future__ import annotations

import pytest
from support.hf_models import builtin_dir
from rlkube.core.hf.loading import load_tokenizer
from rlkube.core.inference.openai_api import (
    RequestError,
    ServedModel,
    StreamChunks,
    completion_response,
    parse_completion_request,
)
from rlkube.core.inference.sampling import Completion, GenerationResult

TOK = load_tokenizer(builtin_dir())
SERVED = ServedModel("builtin://tiny-llama", TOK, 16)


def test_defaults_and_both_prompt_forms():
    r = parse_completion_request({"prompt": "12:"}, SERVED)
    # the tokenizer's post-processor prepends <bos>, as vLLM's completions endpoint does for a Llama tokenizer
    assert r.prompt_ids == [TOK.bos_id, *(TOK.hf.convert_tokens_to_ids(c) for c in "12:")]
    # max_tokens defaults to OpenAI's 16, cut to the 12 tokens the 16-token context leaves after the prompt
    assert (r.n, r.max_tokens, r.temperature, r.top_logprobs, r.seed, r.stop, r.min_version) == (
        1, 12, 1.0, None, None, (), None)
    ids = parse_completion_request({"prompt": [1, 5, 6], "n": 3, "max_tokens": 4, "logprobs": 0, "seed": 2,
                                    "stop": "x", "min_model_version": 4, "model": "builtin://tiny-llama"}, SERVED)
    assert (ids.prompt_ids, ids.n, ids.max_tokens, ids.top_logprobs, ids.seed, ids.stop, ids.min_version) == (
        [1, 5, 6], 3, 4, 0, 2, ("x",), 4)


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"prompt": "12:", "model": "gpt-4"}, "model", 404),
        ({}, "prompt", 400),
        ({"prompt": "ABC"}, "prompt", 400),  # not in the alphabet: <unk>
        ({"prompt": [1, 999]}, "prompt", 400),
        ({"prompt": ["a", "b"]}, "prompt", 400),
        ({"prompt": "1:", "n": 0}, "n", 400),
        ({"prompt": "1:", "n": 1000}, "n", 400),
        ({"prompt": "1:", "max_tokens": 15}, "max_tokens", 400),  # 3 prompt tokens + 15 > 16
        ({"prompt": "123456789012345:"}, "prompt", 400),  # 17 tokens: no room at all
        ({"prompt": "1:", "temperature": -1}, "temperature", 400),
        ({"prompt": "1:", "logprobs": 99}, "logprobs", 400),
        ({"prompt": "1:", "seed": "x"}, "seed", 400),
        ({"prompt": "1:", "stop": [1]}, "stop", 400),
        ({"prompt": "1:", "top_p": 0.5}, "top_p", 400),
        ({"prompt": "1:", "stream": "yes"}, "stream", 400),
        ({"prompt": "1:", "stream_options": {"include_usage": True}}, "stream_options", 400),  # without stream
        ({"prompt": "1:", "stream": True, "stream_options": {"other": 1}}, "stream_options", 400),
        ({"prompt": "1:", "min_model_version": -1}, "min_model_version", 400),
    ],
)
def test_bad_requests_name_the_field(body, param, status):
    with pytest.raises(RequestError) as info:
        parse_completion_request(body, SERVED)
    assert info.value.param == param and info.value.status == status
    assert info.value.body()["error"]["param"] == param


def test_neutral_values_of_unsupported_parameters_are_accepted():
    parse_completion_request({"prompt": "1:", "top_p": 1, "top_k": -1, "stream": False, "echo": False}, SERVED)


def test_response_carries_tokens_logprobs_and_the_version():
    req = parse_completion_request({"prompt": "1:", "n": 2, "max_tokens": 3, "logprobs": 0}, SERVED)
    result = GenerationResult(5, [
        Completion(token_ids=[4, 5], logprobs=[-0.1, -0.2], text="12", finish_reason="stop"),
        Completion(token_ids=[6, 6, 6], logprobs=[-1.0, -1.0, -1.0], text="333", finish_reason="length"),
    ])
    body = completion_response(req, result, SERVED)
    assert body["object"] == "text_completion" and body["model_version"] == 5
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    first, second = body["choices"]
    assert (first["index"], first["text"], first["finish_reason"], first["token_ids"]) == (0, "12", "stop", [4, 5])
    assert first["prompt_token_ids"] == req.prompt_ids
    assert first["logprobs"]["tokens"] == [TOK.token_text(4), TOK.token_text(5)] == ["0", "1"]
    assert first["logprobs"]["token_logprobs"] == [-0.1, -0.2]
    assert first["logprobs"]["text_offset"] == [0, 1]
    assert second["finish_reason"] == "length"
    no_lp = completion_response(parse_completion_request({"prompt": "1:"}, SERVED), result, SERVED)
    assert no_lp["choices"][0]["logprobs"] is None


def test_a_response_across_an_update_reports_every_span_and_the_oldest_version():
    req = parse_completion_request({"prompt": "1:", "n": 2, "max_tokens": 3}, SERVED)
    result = GenerationResult(4, [
        Completion(token_ids=[4, 5, 6], logprobs=[], text="123", versions=[[0, 4], [2, 5]]),
        Completion(token_ids=[6], logprobs=[], text="3"),
    ])
    body = completion_response(req, result, SERVED)
    assert body["model_version"] == 4
    assert [c["model_versions"] for c in body["choices"]] == [[[0, 4], [2, 5]], [[0, 4]]]
    later = GenerationResult(5, [Completion(token_ids=[4], logprobs=[], versions=[[0, 6]])])
    assert completion_response(req, later, SERVED)["model_version"] == 6


def test_a_finished_result_streams_as_one_chunk_per_choice_and_version():
    req = parse_completion_request({"prompt": "1:", "n": 2, "max_tokens": 3, "logprobs": 0, "stream": True,
                                    "stream_options": {"include_usage": True}}, SERVED)
    assert req.stream and req.include_usage
    result = GenerationResult(4, [
        Completion(token_ids=[4, 5, 6], logprobs=[-0.1, -0.2, -0.3], text="123", finish_reason="stop",
                   versions=[[0, 4], [2, 5]]),
        Completion(token_ids=[6], logprobs=[-1.0], text="3"),
    ])
    chunks = StreamChunks(req, SERVED).of_result(result)
    pieces = [(c["choices"][0]["index"], c["choices"][0]["token_ids"], c["model_version"],
               c["choices"][0]["finish_reason"], c["choices"][0]["text"]) for c in chunks[:-1]]
    assert pieces == [(0, [4, 5], 4, None, ""), (0, [6], 5, "stop", "123"), (1, [6], 4, "length", "3")]
    # offsets continue across the chunks of one choice
    assert chunks[1]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert chunks[1]["choices"][0]["logprobs"]["token_logprobs"] == [-0.3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert len({c["id"] for c in chunks}) == 1
    assert [("prompt_token_ids" in c["choices"][0]) for c in chunks[:-1]] == [True, False, True]
