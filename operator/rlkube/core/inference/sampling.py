"""Batched sampling for the native inference engine: the torch side of `python -m rlkube.core.inference`.

Kept apart from the HTTP server so it can be driven (and tested) without a socket. One worker thread takes every
request that may run, runs them as ONE batch (all `n` samples of every request), and answers each request's
future. The model is any supported Hugging Face causal LM (transformers), generating with a KV cache
(DynamicCache): one prefill of the prompts, then one token per row per forward pass. Prompts of different lengths
are LEFT-padded with an attention mask and position ids counted from each row's first real token, so every row
computes exactly what it would alone (RoPE positions are relative to the row's start).

The policy (model, version) is one immutable pair swapped by reference: a batch samples every token with the
pair it took at its start, and a weight update never waits for generation nor generation for an update.
A request may ask for `min_version` (the actor does, right after a `weights_ready` announcement, whose transfer
follows it): it waits, without holding up the others, until that version is in, the versions go back (a
restarted trainer) or MIN_VERSION_WAIT_S passed.

Shutting down (`shutdown()`/`stop()`) never waits for such a request: every request not yet in a batch fails at
once with `EngineStopped` (the server answers 503), and only the batch being sampled is finished.

Log-probs are those of the distribution actually sampled from, i.e. of logits / temperature (for temperature 0,
of the raw logits), which is what the trainer's importance ratio needs (`model.token_logprobs` with the same
temperature reproduces them; `losses.token_logprobs` on the trainer's side).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from rlkube.core.hf.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A request asking for newer weights waits this long at most, then runs anyway: the announced transfer normally
# follows within milliseconds on the tiny models this engine serves, but the trainer may die before it.
MIN_VERSION_WAIT_S = 5.0


class EngineStopped(RuntimeError):
    """The engine is shutting down: a request it had not started sampling is refused with this."""


@dataclass(frozen=True)
class Policy:
    model: torch.nn.Module
    version: int


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_logprobs: int | None = None  # None: no log-probs wanted; 0: the sampled token's; k: plus the top k
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_version: int | None = None  # wait (up to MIN_VERSION_WAIT_S) until the policy is at least this version
    # answer as server-sent events (rlkube.core.inference.openai_api.stream_chunks), not one object
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with the usage (OpenAI's stream_options.include_usage)


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text: str = ""
    finish_reason: str = "length"
    # [[first token index, weights version], ...]: which weights sampled which tokens, when an update landed
    # mid-request (vLLM); None: every token by the result's `version` (a native batch runs on one policy).
    versions: list[list[int]] | None = None


@dataclass(frozen=True)
class GenerationResult:
    version: int
    completions: list[Completion]


class _Row:
    __slots__ = ("done", "out", "req", "tokens")

    def __init__(self, req: int, prompt: list[int], top: bool):
        self.req = req
        self.tokens = list(prompt)
        self.out = Completion(top_logprobs=[] if top else None)
        self.done = False


class SamplingEngine:
    """Owns the current policy and the generation worker thread."""

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, version: int = 0, seed: int = 0,
                 max_batch_rows: int = 512):
        model.eval()
        self._policy = Policy(model, version)
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        self._seeds = random.Random(seed)
        self._pending: list[tuple[GenerationRequest, Future, float]] = []  # (request, future, deadline)
        self._cv = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.rows = 0
        self.tokens_generated = 0

    # --- policy ----------------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self._policy

    def set_policy(self, model: torch.nn.Module, version: int) -> None:
        """Swap the weights in; batches already running finish with the policy they started with."""
        model.eval()
        with self._cv:
            if version < self._policy.version:
                # A restarted trainer counts from its checkpoint again: the versions requests are waiting for
                # may come much later (or, from the lost run, never). Let them run now.
                now = time.monotonic()
                self._pending = [(req, fut, min(deadline, now)) for req, fut, deadline in self._pending]
            self._policy = Policy(model, version)
            self._cv.notify_all()  # requests waiting for this version

    # --- requests --------------------------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._stop.is_set():
                fut.set_exception(EngineStopped("the inference server is shutting down"))
                return fut
            self._pending.append((req, fut, time.monotonic() + MIN_VERSION_WAIT_S))
            self._cv.notify_all()
        return fut

    def start(self) -> SamplingEngine:
        self._thread = threading.Thread(target=self._work, name="sampling-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self) -> None:
        """Take no more requests and refuse the waiting ones (EngineStopped); the running batch still finishes.
        Does not block (an event loop may call it)."""
        with self._cv:
            self._stop.set()
            refused, self._pending = self._pending, []
            self._cv.notify_all()
        for _, fut, _ in refused:
            if fut.set_running_or_notify_cancel():  # False: the asker gave up already (cancelled)
                fut.set_exception(EngineStopped("the inference server is shutting down"))

    def stop(self, timeout: float = 10.0) -> bool:
        """shutdown(), then wait up to `timeout` s for the running batch; True when the worker thread ended."""
        self.shutdown()
        if self._thread is None:
            return True
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _take_ready(self) -> list[tuple[GenerationRequest, Future]]:
        """Wait for requests that may run now (their min_version is reached or their wait is over)."""
        with self._cv:
            while not self._stop.is_set():
                now, version = time.monotonic(), self._policy.version
                ready, rows, waiting = [], 0, []
                for item in self._pending:
                    req, fut, deadline = item
                    runnable = req.min_version is None or req.min_version <= version or deadline <= now
                    if runnable and (not ready or rows + req.n <= self.max_batch_rows):
                        ready.append((req, fut))
                        rows += req.n
                    else:
                        waiting.append(item)
                if ready:
                    self._pending = waiting
                    return ready
                next_deadline = min((d for _, _, d in self._pending), default=now + 1.0)
                self._cv.wait(timeout=max(0.01, min(1.0, next_deadline - now)))
        return []

    def _work(self) -> None:
        while not self._stop.is_set():
            batch = self._take_ready()
            live = [(req, fut) for req, fut in batch if fut.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                results = self.generate([req for req, _ in live])
            except Exception as exc:
                log.exception("generation batch failed")
                for _, fut in live:
                    fut.set_exception(exc)
                continue
            for (_, fut), result in zip(live, results, strict=True):
                fut.set_result(result)

    # --- the batch ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, reqs: list[GenerationRequest]) -> list[GenerationResult]:
        """Sample every request's n completions in one batch with the current policy."""
        from transformers import DynamicCache

        policy = self._policy
        model = policy.model
        device = next(model.parameters()).device
        gens = []
        for req in reqs:
            seed = req.seed if req.seed is not None else self._seeds.getrandbits(63)
            gens.append(torch.Generator(device=device).manual_seed(seed))
        rows = [_Row(i, req.prompt_ids, bool(req.top_logprobs)) for i, req in enumerate(reqs) for _ in range(req.n)]
        t0 = time.monotonic()
        # Prefill: prompts left-padded; pads are masked out and positions start at each row's first real token.
        width = max(len(r.tokens) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.tokens):] = torch.tensor(r.tokens)
            mask[i, width - len(r.tokens):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1].float()
        max_steps = max(req.max_tokens for req in reqs)
        for step in range(max_steps):
            # Sample per request (each has its own temperature and generator), the active rows of a request together.
            next_ids = torch.full((len(rows),), self.tokenizer.pad_id, dtype=torch.long)
            start = 0
            while start < len(rows):
                req_i = rows[start].req
                end = start
                while end < len(rows) and rows[end].req == req_i:
                    end += 1
                active = [i for i in range(start, end) if not rows[i].done]
                if active:
                    sampled = self._sample(reqs[req_i], gens[req_i], logits[active], [rows[i] for i in active], step)
                    next_ids[active] = torch.tensor(sampled)
                start = end
            if step + 1 == max_steps or all(r.done for r in rows):
                break
            # Decode: one token per row (finished rows too: dropping them from the cache costs more than it saves).
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=next_ids[:, None].to(device), attention_mask=mask, position_ids=positions,
                           past_key_values=cache, use_cache=True).logits[:, -1].float()
        for r in rows:
            if not r.done:
                r.out.text = self.tokenizer.decode(r.out.token_ids)
        self.batches += 1
        self.rows += len(rows)
        self.tokens_generated += sum(len(r.out.token_ids) for r in rows)
        log.debug("batch of %d rows in %.3fs", len(rows), time.monotonic() - t0)
        out: list[list[Completion]] = [[] for _ in reqs]
        for r in rows:
            out[r.req].append(r.out)
        return [GenerationResult(policy.version, comps) for comps in out]

    def _sample(self, req: GenerationRequest, gen: torch.Generator, logits: torch.Tensor, rows: list[_Row],
                step: int) -> list[int]:
        """Sample one token for each of `rows` (one request's active rows) from their `logits`; returns them."""
        if req.temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tokens = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / req.temperature, dim=-1)
            tokens = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        tokens = tokens.tolist()
        if req.top_logprobs:
            top_v, top_i = logp.topk(req.top_logprobs, dim=-1)
        tok = self.tokenizer
        for i, r in enumerate(rows):
            tok_id = tokens[i]
            r.tokens.append(tok_id)
            r.out.token_ids.append(tok_id)
            r.out.logprobs.append(chosen[i])
            if req.top_logprobs:
                r.out.top_logprobs.append(
                    {tok.token_text(j): v for j, v in zip(top_i[i].tolist(), top_v[i].tolist(), strict=True)}
                )
            if tok_id in tok.eos_ids:
                r.done, r.out.finish_reason = True, "stop"
                r.out.text = tok.decode(r.out.token_ids)
            elif req.stop:
                text = tok.decode(r.out.token_ids)
                hits = [text.find(s) for s in req.stop if s and s in text]
                if hits:
                    # As the OpenAI API does: the text ends before the stop string (the tokens keep it: they
                    # were sampled, and the trainer needs them with their log-probs).
                    r.done, r.out.finish_reason, r.out.text = True, "stop", text[: min(hits)]
            if not r.done and step + 1 >= req.max_tokens:
                r.done, r.out.finish_reason = True, "length"
                r.out.text = tok.decode(r.out.token_ids)
        return tokens
