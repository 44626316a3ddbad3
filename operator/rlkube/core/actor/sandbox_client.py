"""The actor's side of the sandbox pods (spec.sandbox.mode `pods`): the same `run(code)` / `python_tool(code)` as the
in-process Sandbox (rlkube.core.actor.sandbox), sent over HTTP to the job's sandbox servers
(rlkube.core.sandbox.server, runtime.ENV_SANDBOX_URLS).

Calls go round-robin over the servers. A server that does not answer (its pod died mid-snippet, or is being
replaced: the operator recreates it, docs/design.md §3) answers the call as a tool error, outcome `unavailable`,
and the episode goes on; the next call goes to the next server. Blocking on purpose: tools run on a thread of their
own (rlkube.core.actor.episodes.call_with_timeout), never on the actor's event loop.
"""

from __future__ import annotations

import itertools
import json
import threading
import urllib.error
import urllib.request

from rlkube.core.actor.sandbox import SandboxLimits, SandboxResult, count_outcome

CONNECT_SLACK_S = 5.0
"""Seconds over the snippet's own wall limit an HTTP call may take (queueing behind other snippets, the network)."""


class RemoteSandbox:
    """Snippets run by the sandbox servers at `urls` (base URLs, `http://host:port`)."""

    def __init__(self, urls: list[str], limits: SandboxLimits):
        if not urls:
            raise ValueError("no sandbox server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.limits = limits  # what the servers were given (they enforce their own copy)
        self.layers: tuple[str, ...] = ("pod",)
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()

    def _pick(self) -> str:
        with self._lock:
            return self.urls[next(self._next)]

    def run(self, code: str) -> SandboxResult:
        """Counted on the current episode as the in-process Sandbox.run counts (rlkube.core.actor.episodes.note_tool)."""
        return count_outcome(self._call(code))

    def python_tool(self, code: str) -> str:
        return self.run(code).message()

    def _call(self, code: str) -> SandboxResult:
        url = self._pick()
        body = json.dumps({"code": code}).encode()
        request = urllib.request.Request(f"{url}/run", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.limits.timeout_s + CONNECT_SLACK_S) as resp:
                doc = json.loads(resp.read())
        except (OSError, ValueError) as exc:  # refused, reset, timed out, a 5xx, a half-written answer
            why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            return SandboxResult(outcome="unavailable", stderr=f"{url}: {type(exc).__name__}: {why}", server=url)
        result = SandboxResult.from_json(doc)
        result.server = url
        return result
