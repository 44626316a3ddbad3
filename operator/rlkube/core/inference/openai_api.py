"""The OpenAI completions API as the native inference server speaks it: request checks and response shapes.

Pure functions (no I/O), so every bad-input message can be tested without a server. The response follows
OpenAI's `text_completion` object with vLLM's extensions that an RL actor needs: per choice `token_ids` (the
sampled completion tokens) and `prompt_token_ids`, and a top-level `model_version` (the weights version that
produced every choice of the response: the OLDEST when an update landed mid-request, so lag accounting stays on
the safe side) and per choice `model_versions`, the spans `[[first token index, version], ...]` saying which
weights sampled which tokens. One request extension of ours: `min_model_version` makes the request wait (bounded)
until the server has at least that weights version (the actor uses it right after an announcement, whose transfer
follows it).

`stream: true` answers as OpenAI does, server-sent events (`data: {chunk}` ... `data: [DONE]`), each chunk a
`text_completion` object with one choice's next tokens; ours also carry `token_ids` and the `model_version` of
exactly those tokens (a chunk never spans two versions: it is split where an update landed). The native engine
samples a request as one batch, so its stream is one chunk per choice (and version) when the batch is done; vLLM
streams as it samples (rlkube.core.inference.vllm_engine). `StreamChunks` builds the chunks for both.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from rlkube.core.hf.tokenizer import Tokenizer
from rlkube.core.inference.sampling import Completion, GenerationRequest, GenerationResult

MAX_N = 256
DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
# Sampling parameters we do not implement: accepted only at their neutral value, rejected otherwise, so a
# client never silently gets a different distribution than it asked for.
NEUTRAL = {"top_p": 1, "top_k": -1, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False,
           "suffix": None, "logit_bias": None}
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class RequestError(ValueError):
    """A bad request: `param` names the offending field, `status` the HTTP status to answer with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.status = status
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: Tokenizer
    max_sequence_length: int


def _int(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"`{name}` must be an integer, got {value!r}", name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"`{name}` must be {bound}, got {value}", name)
    return value


def parse_completion_request(body: Any, served: ServedModel) -> GenerationRequest:
    """Check a POST /v1/completions body; RequestError names the field on bad input."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served.name:
        raise RequestError(f"the model `{model}` does not exist; this server serves `{served.name}`", "model",
                           404, "NotFoundError")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] != neutral and not (name == "top_k" and body[name] in (0, -1)):
            raise RequestError(f"`{name}`={body[name]!r} is not supported by the native engine", name)

    prompt = body.get("prompt")
    tok = served.tokenizer
    if isinstance(prompt, str):
        # Special tokens added as vLLM adds them to a completions prompt (a Llama tokenizer's BOS).
        prompt_ids = tok.encode(prompt)
        if tok.unk_id is not None and tok.unk_id in prompt_ids:
            # A prompt the tokenizer cannot represent would be sampled from as if it said <unk>: refuse it.
            raise RequestError("`prompt` has characters the model's tokenizer does not know (they encode to "
                               f"{tok.token_text(tok.unk_id)!r})", "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < tok.vocab_size]
        if bad:
            raise RequestError(f"`prompt`: token ids {bad[:5]} outside the vocabulary [0, {tok.vocab_size})", "prompt")
        prompt_ids = list(prompt)
    elif isinstance(prompt, list):
        raise RequestError("`prompt` must be a string or a non-empty list of token ids (one prompt per request; "
                           "use `n` for several samples)", "prompt")
    else:
        raise RequestError("`prompt` is required: a string or a list of token ids", "prompt")

    n = _int(body, "n", 1, 1, MAX_N)
    room = served.max_sequence_length - len(prompt_ids)
    if room < 1:
        raise RequestError(f"`prompt` has {len(prompt_ids)} tokens: no room left in the model's maximum sequence "
                           f"length {served.max_sequence_length}", "prompt")
    max_tokens = _int(body, "max_tokens", None, 1)
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)  # OpenAI's default, within what the context leaves
    elif max_tokens > room:
        raise RequestError(
            f"`max_tokens`={max_tokens} plus the prompt's {len(prompt_ids)} tokens exceed the model's maximum "
            f"sequence length {served.max_sequence_length}", "max_tokens")
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature < 0:
        raise RequestError(f"`temperature` must be a number >= 0, got {temperature!r}", "temperature")
    top = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"`seed` must be an integer, got {seed!r}", "seed")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise RequestError(f"`stop` must be a string or a list of at most {MAX_STOP} strings", "stop")
    min_version = _int(body, "min_model_version", None, 0)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise RequestError(f"`stream` must be a boolean, got {stream!r}", "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError("`stream_options` is only {\"include_usage\": true|false}, with `stream`: true",
                           "stream_options")
    return GenerationRequest(
        prompt_ids=prompt_ids, n=n, max_tokens=max_tokens, temperature=float(temperature), top_logprobs=top,
        seed=seed, stop=stop, min_version=min_version, stream=stream,
        include_usage=bool(options and options.get("include_usage")),
    )


def _logprobs(tok: Tokenizer, token_ids: list[int], logprobs: list[float], top: list[dict[str, float]] | None,
              start: int = 0) -> dict[str, Any]:
    tokens = [tok.token_text(t) for t in token_ids]
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def version_spans(completion: Completion, version: int) -> list[list[int]]:
    """[[first token index, weights version], ...] of one choice."""
    return [list(s) for s in completion.versions] if completion.versions else [[0, version]]


def oldest_version(completions: list[Completion], version: int) -> int:
    return min((v for c in completions for _, v in version_spans(c, version)), default=version)


def completion_response(req: GenerationRequest, result: GenerationResult, served: ServedModel) -> dict[str, Any]:
    tok = served.tokenizer
    choices = []
    for i, c in enumerate(result.completions):
        logprobs = None
        if req.top_logprobs is not None:
            logprobs = _logprobs(tok, c.token_ids, c.logprobs, c.top_logprobs)
        choices.append({
            "index": i,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": logprobs,
            "token_ids": c.token_ids,
            "prompt_token_ids": req.prompt_ids,
            "model_versions": version_spans(c, result.version),
        })
    completion_tokens = sum(len(c.token_ids) for c in result.completions)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "model_version": oldest_version(result.completions, result.version),
        "choices": choices,
        "usage": {
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(req.prompt_ids) + completion_tokens,
        },
    }


class StreamChunks:
    """The chunks of one streamed completion, as OpenAI's `stream: true` sends them: `chunk()` per piece of one
    choice (tokens sampled by ONE weights version), `usage()` last when asked for; `sse()` frames one."""

    def __init__(self, req: GenerationRequest, served: ServedModel):
        self.req = req
        self.served = served
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.offsets = [0] * req.n  # per choice: text offset of its next token
        self.started = [False] * req.n  # per choice: its first chunk (which carries prompt_token_ids) went out
        self.completion_tokens = 0

    def chunk(self, index: int, token_ids: list[int], logprobs: list[float], top: list[dict[str, float]] | None,
              text: str, finish_reason: str | None, version: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None,
                                  "token_ids": token_ids}
        if not self.started[index]:
            self.started[index] = True
            choice["prompt_token_ids"] = self.req.prompt_ids
        if self.req.top_logprobs is not None:
            choice["logprobs"] = _logprobs(self.served.tokenizer, token_ids, logprobs, top, self.offsets[index])
            self.offsets[index] = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1]) \
                if token_ids else self.offsets[index]
        self.completion_tokens += len(token_ids)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "model_version": version, "choices": [choice]}

    def usage(self) -> dict[str, Any]:
        prompt = len(self.req.prompt_ids)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                                         "total_tokens": prompt + self.completion_tokens}}

    def of_result(self, result: GenerationResult) -> list[dict[str, Any]]:
        """A finished result as chunks: per choice, one per version span (the text on the last)."""
        chunks = []
        for i, c in enumerate(result.completions):
            spans = version_spans(c, result.version)
            for k, (first, version) in enumerate(spans):
                end = spans[k + 1][0] if k + 1 < len(spans) else len(c.token_ids)
                last = k + 1 == len(spans)
                chunks.append(self.chunk(
                    i, c.token_ids[first:end], c.logprobs[first:end],
                    c.top_logprobs[first:end] if c.top_logprobs is not None else None,
                    c.text if last else "", c.finish_reason if last else None, version))
        if self.req.include_usage:
            chunks.append(self.usage())
        return chunks


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def models_response(served: ServedModel) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{
            "id": served.name, "object": "model", "created": 0, "owned_by": "rlkube",
            "max_model_len": served.max_sequence_length,
        }],
    }
