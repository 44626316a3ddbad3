"""The OpenAI completions API as the native inference server speaks it: request checks and response shapes.

Pure functions (no I/O), so every bad-input message can be tested without a server. The response follows
OpenAI's `text_completion` object with vLLM's extensions that an RL actor needs: per choice `token_ids` (the
sampled completion tokens) and `prompt_token_ids`, and a top-level `model_version` (the weights version that
produced every choice of the response). One request extension of ours: `min_model_version` makes the request
wait (bounded) until the server has at least that weights version (the actor uses it right after an
announcement, whose transfer follows it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlkube.core.hf.tokenizer import Tokenizer
from rlkube.core.sampling import GenerationRequest, GenerationResult

MAX_N = 256
DEFAULT_MAX_TOKENS = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 4
# Sampling parameters we do not implement: accepted only at their neutral value, rejected otherwise, so a
# client never silently gets a different distribution than it asked for.
NEUTRAL = {"top_p": 1, "top_k": -1, "presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False,
           "stream": False, "suffix": None, "logit_bias": None}


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
    return GenerationRequest(
        prompt_ids=prompt_ids, n=n, max_tokens=max_tokens, temperature=float(temperature), top_logprobs=top,
        seed=seed, stop=stop, min_version=min_version,
    )


def completion_response(req: GenerationRequest, result: GenerationResult, served: ServedModel) -> dict[str, Any]:
    tok = served.tokenizer
    choices = []
    for i, c in enumerate(result.completions):
        logprobs = None
        if req.top_logprobs is not None:
            tokens = [tok.token_text(t) for t in c.token_ids]
            offsets, pos = [], 0
            for t in tokens:
                offsets.append(pos)
                pos += len(t)
            logprobs = {
                "tokens": tokens,
                "token_logprobs": c.logprobs,
                "top_logprobs": c.top_logprobs,
                "text_offset": offsets,
            }
        choices.append({
            "index": i,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": logprobs,
            "token_ids": c.token_ids,
            "prompt_token_ids": req.prompt_ids,
        })
    completion_tokens = sum(len(c.token_ids) for c in result.completions)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "model_version": result.version,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(req.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(req.prompt_ids) + completion_tokens,
        },
    }


def models_response(served: ServedModel) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{
            "id": served.name, "object": "model", "created": 0, "owned_by": "rlkube",
            "max_model_len": served.max_sequence_length,
        }],
    }
