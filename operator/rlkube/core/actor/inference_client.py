"""The actor's inference client: health checks and completions requests to the job's inference servers (both engines
behind rlkube.core.inference's shell), retried on the next server until they succeed or the actor stops.

A mixin of rlkube.core.actor.role.Actor, which owns the state it reads (the servers, the spec, the rng) and the stop
(`until_stopped`, `pause`): a failed request is retried on the next server, a 400 skips the prompt (BadPrompt).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

log = logging.getLogger("rlkube.actor")

REQUEST_TIMEOUT_S = 300.0


class InferenceError(RuntimeError):
    pass


class BadPrompt(InferenceError):
    pass


class Stopped(Exception):
    """The actor was asked to stop while it waited (see Actor.until_stopped)."""


class InferenceClient:
    """Requests to the inference servers (mixed into rlkube.core.actor.role.Actor)."""

    async def wait_for_inference(self, session: aiohttp.ClientSession) -> None:
        pending = set(self.urls)
        last_log: float | None = None
        while pending and not self.stop.is_set():
            for url in list(pending):
                try:
                    if await self.until_stopped(self._healthy(session, url)):
                        pending.discard(url)
                except (TimeoutError, aiohttp.ClientError):
                    pass
                except Stopped:
                    return
            if pending and (last_log is None or time.monotonic() - last_log > 30):
                log.info("waiting for inference health: %s", ", ".join(sorted(pending)))
                last_log = time.monotonic()
            if pending:
                await self.pause(0.5)

    @staticmethod
    async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
        async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status == 200

    async def _complete(self, session: aiohttp.ClientSession, url: str, prompt: str | list[int],
                        min_version: int | None, n: int | None = None, max_tokens: int | None = None,
                        temperature: float | None = None, seed: int | None = None) -> dict:
        body = {
            "model": self.spec.model.path,
            "prompt": prompt,
            "n": self.algo.group_size if n is None else n,
            "max_tokens": self.algo.max_new_tokens if max_tokens is None else max_tokens,
            "temperature": self.algo.temperature if temperature is None else temperature,
            "logprobs": 0,
            "seed": self.rng.getrandbits(62) if seed is None else seed,
        }
        if min_version is not None:
            # An extension of our servers (both engines behind rlkube.core.inference's shell).
            body["min_model_version"] = min_version
        try:
            async with session.post(url + "/v1/completions", json=body,
                                    timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
                reply = await resp.json(content_type=None)
                if resp.status == 400:
                    raise BadPrompt(f"{url} rejected the prompt {prompt!r}: {reply}")
                if resp.status != 200:
                    raise InferenceError(f"{url} answered {resp.status}: {reply}")
                return reply
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise InferenceError(f"{url}: {type(exc).__name__}: {exc}") from exc

    async def request(self, session: aiohttp.ClientSession, prompt: str | list[int], min_version: int | None,
                      n: int | None = None, max_tokens: int | None = None, temperature: float | None = None,
                      seed: int | None = None, stop: asyncio.Event | None = None) -> dict:
        """One completions request, retried on the next server (with back-off) until it succeeds. Raises Stopped
        when the actor stops first (`stop`, default `self.stop`), BadPrompt when a server refuses the prompt.
        `temperature` and `seed` default to the job's sampling (evaluation fixes its own)."""
        stop = stop or self.stop
        delay = 0.2
        while not stop.is_set():
            url = self.urls[next(self._servers)]
            try:
                # A server may hold the request (min_model_version) or never answer (frozen): a stop ends it.
                return await self.until_stopped(self._complete(session, url, prompt, min_version, n, max_tokens,
                                                               temperature, seed), stop)
            except BadPrompt:
                raise  # the prompt itself is refused: no server will take it
            except InferenceError as exc:
                log.warning("inference request failed (%s); retrying in %.1fs", exc, delay)
                await self.pause(delay, stop)
                delay = min(delay * 2, 5.0)
        raise Stopped


def token_versions(spans: object, n: int) -> list[int] | None:
    """Our engines' per-choice `model_versions` ([[first token index, version], ...], rlkube.core.inference.openai_api)
    as one version per token; None when absent or malformed (the reply's one `model_version` then stands for all)."""
    if not isinstance(spans, list) or not spans:
        return None
    try:
        starts = [(int(first), int(version)) for first, version in spans]
    except (TypeError, ValueError):
        return None
    if starts[0][0] != 0:
        return None
    out = []
    for k, (first, version) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else n
        out += [version] * max(0, end - first)
    return out if len(out) == n else None
