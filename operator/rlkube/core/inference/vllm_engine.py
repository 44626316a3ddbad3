"""The vLLM inference engine (`spec.inference.engine: vllm`) behind the inference shell
(rlkube.core.inference.shell): vLLM in-process behind our own HTTP routes.

vLLM runs in-process as an `AsyncLLM` (its engine core and worker in child processes vLLM starts) on the shell's
event loop, which serves the same small OpenAI-compatible API as the native engine. Why not vLLM's own OpenAI
server with VLLM_SERVER_DEV_MODE's /collective_rpc: its /health says 200 as soon as the engine is up, while ours
must say 200 only after the server joined the trainer's weight-update group and warmed up (the actors start on
it); its responses carry no weights version, which the actor stamps every rollout with (lag accounting); and the
weight follower would be a second process speaking to it over HTTP. In-process, one event loop owns all three and
a dev-mode endpoint stays closed.

Weight updates reach vLLM's workers through `collective_rpc` into rlkube.core.inference.vllm_worker, each
tensor-parallel worker a rank of the group (docs/design.md §5.6; Fast-LLM's group instead, §8); an update is in effect
once every worker loaded it (`combine_receipts`). A request running across an update finishes, and each choice says
which weights sampled which tokens (`model_versions` spans; `model_version` is the oldest, so lag accounting errs on the
safe side); a streamed chunk never mixes two versions. Engine arguments come from `spec.inference.vllm`
(`engine_cli_args`, pure, `extraEngineArgs` last); log-probs are vLLM's `processed_logprobs`, the distribution
actually sampled. Where vllm is not importable, the shell re-executes with RLKUBE_VLLM_PYTHON (`make deps-vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.contract import fast_llm_rendezvous, weight_transport
from rlkube.contract.context import RoleContext
from rlkube.contract.fast_llm_rendezvous import EPOCH
from rlkube.contract.parallel import tensor_parallel_heads_error
from rlkube.contract.weight_transport import TransportMismatch
from rlkube.core.errors import ConfigError
from rlkube.core.hf.loading import load_config, load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.inference.engine import PARAMETERS, RECEIVE_TIMEOUT_S, RECEIVED, Engine, Received, UpdateRefused
from rlkube.core.inference.weight_source import FastLlmBroadcast, WeightSource, weight_source
from rlkube.core.inference.openai_api import ServedModel
from rlkube.core.inference.sampling import Completion, GenerationRequest, GenerationResult
from rlkube.core.weights.group import StaleEpoch, WeightSyncError

# The worker extension is imported by vLLM's worker processes by name; importing it here too makes the image's
# build-time import check (images/vllm, MODULES) cover it.
from rlkube.core.inference.vllm_worker import ENV_SERVER_PID, EXTENSION

# vllm (and psutil) are imported inside the functions that use them: this interpreter may have no vllm, in which
# case the shell re-executes itself under RLKUBE_VLLM_PYTHON.

ENV_VLLM_PYTHON = "RLKUBE_VLLM_PYTHON"
"""Interpreter of an environment with vllm, used when the current one has none (local runs and tests)."""
_REEXECUTED = "RLKUBE_VLLM_REEXECUTED"  # set on the re-executed process: never hop twice
SHELL_MODULE = "rlkube.core.inference"
"""What the re-executed interpreter runs: the inference role again."""

log = logging.getLogger("rlkube.inference.vllm")

JOIN_POLL_S = 0.5  # how often the engine asks the workers whether they joined Fast-LLM's group
WARMUP_PROMPTS = 8
WARMUP_TOKENS = 8
MIN_VERSION_WAIT_S = 5.0  # as rlkube.core.inference.sampling
STOP_WAIT_S = 3.0  # vLLM's engine processes get this long to stop after SIGTERM, then are killed
LEAVE_WAIT_S = 2.0  # leaving the group at shutdown: the engine may be stopping already
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
        os.execve(python, [python, "-m", SHELL_MODULE], {**env, _REEXECUTED: "1"})
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
            "mismatch": any(r.get("mismatch") for r in failed),
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



@dataclass(frozen=True)
class WeightGroup:
    """Where the workers join the trainer's weight-update group: `rank` is this server's first (each worker adds its
    tensor-parallel rank), and the worker method that receives an update of it (`receive_rpc`, called with the
    announced step). Fast-LLM's broadcast (`world_size` its group's, joined at start-up with `join_broadcast`):
    `fast_llm_backend` and `fast_llm_timeout_s` its."""

    addr: str
    rank: int
    world_size: int
    bind_host: str | None
    receive_rpc: str = "rlkube_receive"
    fast_llm_backend: str | None = None
    fast_llm_timeout_s: float = 3600.0
    # What each worker derives its transport from (rlkube.contract.weight_transport, beside its own device) and the
    # transfer dtype it expects (`auto`: the dtype served).
    trainer_device: str = "cpu"
    placement: str = weight_transport.SEPARATE
    transfer_dtype: str | None = None


class VllmEngine(Engine):
    """The AsyncLLM, the served version and the request path; lives on the server's event loop, and takes weight
    updates from the shell's follower thread through its workers (`collective_rpc`, run on that loop).

    Versions are truthful per token span: while an update may be loading (`_settled` cleared BEFORE the workers are
    asked to receive) nothing is handed out, then the worker's progress report says where each running request's
    tokens switched weights (rlkube.core.inference.vllm_worker)."""

    name = "vllm"
    version = 0  # a plain attribute, set on the event loop when an update is in effect (end_update)

    def __init__(self, llm, served, loop: asyncio.AbstractEventLoop, group: WeightGroup | None = None,
                 source: WeightSource | None = None):
        self.llm = llm
        self.served = served
        self.loop = loop
        self.group = group
        self.source = source if source is not None else WeightSource()
        self.epoch: str | None = None
        self.ranks: list[int] = []  # the group ranks this server's workers joined as (one per tensor-parallel rank)
        self.world_size = group.world_size if group is not None else 0
        self.version = 0
        self.warm = False
        self._warm_task: asyncio.Future | None = None
        self._version_changed = asyncio.Condition()
        self._running: dict[str, _Versions] = {}
        self._settled = asyncio.Event()
        self._settled.set()

    @property
    def joined(self) -> bool:
        return self.epoch is not None

    def ready(self) -> bool:
        return self.warm

    # --- weight updates (the follower's thread) ---------------------------------------------------------------

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _rpc(self, method: str, *args, timeout: float | None = None) -> list[Any]:
        """`method` on every worker (one per tensor-parallel rank), their results in rank order."""
        return self._call(self.llm.collective_rpc(method, args=args), timeout)

    def join_broadcast(self, stop: threading.Event) -> bool:
        """Every worker into Fast-LLM's broadcast group (rlkube.core.weights.fast_llm). The workers join in threads
        of their own (the engine keeps serving); this polls them."""
        g = self.group
        started = self._rpc("rlkube_fast_llm_join", g.addr, g.rank, g.world_size, g.fast_llm_timeout_s,
                            g.fast_llm_backend, g.bind_host)
        errors = [r["error"] for r in started if not r["ok"]]
        while not errors and not stop.wait(JOIN_POLL_S):
            status = self._rpc("rlkube_fast_llm_status")
            errors = [r["error"] for r in status if r["error"]]
            if not errors and all(r["joined"] for r in status):
                self.epoch, self.ranks = EPOCH, [r["rank"] for r in status]
                self.fast_llm_generation = status[0].get("generation")
                return True
        if errors:
            self._rpc("rlkube_leave")  # a worker that did join holds a group its siblings are not in
            raise WeightSyncError("; ".join(dict.fromkeys(errors)))
        return False

    def join(self, epoch: str) -> None:
        g = self.group
        joined = combine_joins(self._rpc("rlkube_join", g.addr, g.rank, g.world_size, epoch, RECEIVE_TIMEOUT_S,
                                         g.bind_host, g.trainer_device, g.placement, g.transfer_dtype))
        if not joined["ok"]:
            self._rpc("rlkube_leave")  # a worker that did join holds a group its siblings are not in
            self.epoch = None
            if joined.get("mismatch"):
                raise TransportMismatch(f"joining epoch {epoch}: {joined['error']}")
            raise (StaleEpoch if joined.get("stale") else WeightSyncError)(f"joining epoch {epoch}: {joined['error']}")
        self.epoch = epoch
        self.ranks = joined["ranks"]

    def receive_announced(self, step: int) -> Received:
        """The workers' receive (the group's `receive_rpc`, told the announced `step`: Fast-LLM's version); nothing
        is handed out until `apply` says which weights sampled it (or the update is refused)."""
        self._call(self.begin_update())
        try:
            got = self._call(self._receive_and_reset(self.group.receive_rpc, step))
        except BaseException:
            self._call(self.end_update())
            raise
        if not got["ok"]:
            self._call(self.end_update())
            self.epoch = None  # the workers left the group; the next announcement (or a new epoch) rejoins
            if not got.get("fatal"):
                # A worker whose transfer did not fail may still hold the group its siblings left (a failed
                # receive of ours has left it already in every worker: then this does nothing).
                self._rpc("rlkube_leave")
            raise UpdateRefused(got["error"], fatal=bool(got.get("fatal")))
        served = got["served_checksum"]
        return Received(version=got["version"], adapter=False,
                        checksum=served if served is not None else got["checksum"],
                        checksum_source=PARAMETERS if served is not None else RECEIVED,
                        transfer_s=got["transfer_s"], load_s=got["load_s"], loaded=got.get("progress"))

    def apply(self, update: Received) -> None:
        self._call(self.end_update(update.version, update.loaded))

    def leave(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self._rpc("rlkube_leave", timeout=LEAVE_WAIT_S)
        except Exception as exc:  # stopping: vLLM's processes are stopped next whatever their group
            log.warning("leaving the weight-update group: %r", exc)
        self.epoch = None

    async def _receive_and_reset(self, method: str, *args) -> dict[str, Any]:
        """The worker's receive, and right behind it a reset of the prefix cache that also preempts the running
        requests: KV computed with the old weights, cached for prefixes or held by running requests, must not be
        attended to by tokens of the new ones. Both are sent before the first returns, so the engine core finds
        the reset queued when the load ends and applies it before its next step (it drains its input queue
        between steps): no step runs on new weights with old KV (each preempted request recomputes its KV)."""
        got, reset = await asyncio.gather(self.llm.collective_rpc(method, args=args),
                                          self.llm.reset_prefix_cache(reset_running_requests=True),
                                          return_exceptions=False)
        if not reset:
            log.warning("the prefix cache could not be reset")
        return combine_receipts(got)

    # --- the version stamp and the request path (the event loop) ---------------------------------------------

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
        """One parsed request (rlkube.core.inference.sampling.GenerationRequest) -> GenerationResult."""
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
        """Chunks (rlkube.core.inference.openai_api.StreamChunks) as vLLM samples: one per choice's new tokens and
        version."""
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

    def start(self) -> None:
        self._warm_task = asyncio.ensure_future(self.warm_up())

    def shutdown(self) -> None:
        if self._warm_task is not None:
            self._warm_task.cancel()

    async def close(self) -> str | None:
        self.shutdown()
        stopper = threading.Thread(target=self.llm.shutdown, daemon=True)
        stopper.start()
        await asyncio.to_thread(stopper.join, STOP_WAIT_S)
        _kill_children()
        return None


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


def weight_group(ctx: RoleContext, source: WeightSource | None = None) -> WeightGroup:
    """Where the workers join the trainer's own group, and what each derives its transport from (the trainer's
    device and the placement from the spec, beside its own device: rlkube.contract.weight_transport). A Fast-LLM
    trainer broadcasts its own way: its rendezvous, ranks, backend and timeout (rlkube.core.weights.fast_llm)."""
    spec = ctx.spec
    if isinstance(source if source is not None else weight_source(spec), FastLlmBroadcast):
        return WeightGroup(ctx.weight_sync_addr, ctx.weight_sync_rank(), fast_llm_rendezvous.world_size(spec),
                           ctx.bind_host, receive_rpc="rlkube_fast_llm_receive",
                           fast_llm_backend=fast_llm_rendezvous.broadcast_backend(spec),
                           fast_llm_timeout_s=fast_llm_rendezvous.broadcast_timeout_s(spec))
    return WeightGroup(ctx.weight_sync_addr, ctx.weight_sync_rank(), ctx.weight_sync_world_size, ctx.bind_host,
                       trainer_device=weight_transport.trainer_device(spec), placement=weight_transport.placement(spec),
                       transfer_dtype=weight_transport.transfer_dtype_name(spec))


async def open_engine(ctx: RoleContext) -> VllmEngine:
    """vLLM started on the running event loop for the job's model, its workers checked to be one per
    spec.inference.tensorParallel rank (not joined to the weight-update group yet)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    spec = ctx.spec
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
    t0 = time.monotonic()
    llm = AsyncLLM.from_engine_args(engine_args)
    log.info("vLLM engine up in %.1fs", time.monotonic() - t0)
    await llm.collective_rpc("rlkube_track")  # before any request (rlkube.core.inference.vllm_worker)
    tp_ranks = await llm.collective_rpc("rlkube_tp_rank")
    if sorted(tp_ranks) != list(range(spec.inference.tensor_parallel)):
        # Each worker joins as base + its rank: ranks other than 0..tensorParallel-1 (pipeline parallelism in
        # extraEngineArgs, say) would collide with the next server's or fall outside the group.
        raise SystemExit(f"vLLM runs workers of ranks {tp_ranks}; the weight-update group expects one per "
                         f"spec.inference.tensorParallel ({spec.inference.tensor_parallel}) rank, 0 to "
                         f"{spec.inference.tensor_parallel - 1}")
    source = weight_source(spec)  # chosen once: the workers' group and receive method are that source's
    return VllmEngine(llm, served, asyncio.get_running_loop(), weight_group(ctx, source), source)
