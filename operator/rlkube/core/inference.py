"""The inference role (`python -m rlkube.core.inference`): engine `native`, a small OpenAI-compatible server.

An aiohttp server on RLKUBE_BIND_HOST:RLKUBE_PORT with POST /v1/completions, GET /v1/models and GET /health,
sampling with `SamplingEngine` (core/sampling.py, a KV cache) from the job's Hugging Face model directory (the
same directory the trainer starts from, materialized from `spec.model.path`), in `spec.model.dtype`.

A background thread (`WeightFollower`) follows the trainer's events stream. On `weights_ready` it joins the
announced epoch's weight-update group when it is a new one (leaving the old), receives the weights (HF names,
the transfer dtype), loads them by name into a copy of the model (converting to the served dtype) and swaps it
in; generation keeps going meanwhile (docs/references.md §6.4: the first update must not pause generation, so
requests are never gated on the update). A LoRA job's update is the adapter alone (kind "lora-adapter",
rlkube.core.weightsync): the follower serves base + adapter by setting W = W0 + scaling x B @ A for each adapted
weight of the copy, W0 from the base it loaded at start (rlkube.core.lora.merge_into), so sampling costs what it
costs without LoRA and the update moves only the adapter's bytes. /health answers 200 only once the first update arrived over the group
(so the server has joined it; the trainer's start-up push makes that happen without any training step). On
`training_finished` it leaves the group, as the trainer does on the same event (docs/references.md §6.5), and
the server keeps serving until SIGTERM, then exits 0.

SIGTERM must end the process within a teardown grace period (seconds) in every state, and the follower may be
blocked inside the group then: in the rendezvous of an announced epoch or in a receive that the trainer (alive,
frozen, or gone before its store answered) does not complete, for up to RECEIVE_TIMEOUT_S. Gloo cannot interrupt
that (ProcessGroupGloo.abort() does nothing), destroying the group waits for the blocked collective
(~ProcessGroupGloo joins its worker threads), and the interpreter's exit may wait for it too or abort in C++
teardown. So a follower still blocked after a short wait is left as it is, group included, and the process
leaves with os._exit(0). Requests get the same care: on
shutdown the engine refuses those not yet sampled (503; one may wait MIN_VERSION_WAIT_S for a version) instead
of holding the server's graceful shutdown.

`engine: vllm` is served by rlkube.core.vllm_server (vLLM in-process behind the same HTTP routes); pods run this
module for both engines, and it hands over to that one (which fails fast, with the reason, without vllm).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import sys
import threading
import time
from typing import Any

import orjson
import redis
import torch
from aiohttp import web

from rlkube.contract import fast_llm_rendezvous, protocol, runtime, streams
from rlkube.contract.context import RoleContext
from rlkube.core.fast_llm_weights import FastLlmReceiver
from rlkube.core import lora
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import check_sequence_length, load_model, load_tokenizer
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
from rlkube.core.sampling import EngineStopped, SamplingEngine
from rlkube.core.weightsync import ADAPTER, StaleEpoch, WeightReceiver, WeightSyncError, weights_checksum

log = logging.getLogger("rlkube.inference")

RECEIVE_TIMEOUT_S = 120.0  # per collective once an announcement was seen; the trainer sends right after it
EVENTS_BLOCK_MS = 200  # XREAD block of the follower: how soon it notices a stop while idle
# After SIGTERM: in-flight requests get HTTP_SHUTDOWN_S (only a running batch is left to finish, see above); the
# follower and the sampling thread get STOP_WAIT_S each before they are left behind.
HTTP_SHUTDOWN_S = 1.0
STOP_WAIT_S = 0.5



def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


class WeightFollower:
    """Follows the events stream and applies every announced weight update to the engine."""

    def __init__(self, client: redis.Redis, keys: protocol.StreamKeys, receiver: WeightReceiver,
                 engine: SamplingEngine, template: torch.nn.Module):
        self.redis = client
        self.keys = keys
        self.receiver = receiver
        self.engine = engine
        self.template = template  # the model a received update is loaded into (a copy of it per update)
        self.aliases = hf_state.tied_aliases(template)  # received without tied duplicates: put them back
        # The base weights W0 an adapter update is merged onto (the template is never changed: no copy needed).
        self.base = dict(template.named_parameters())
        self.synced = threading.Event()  # set once weights arrived over the group at least once
        self.finished = threading.Event()
        self.updates = 0
        self.last_update_s: float | None = None
        self.last_update_at: float | None = None
        self.served_checksum: float | None = None  # weights_checksum of the served weights in the transfer dtype
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> WeightFollower:
        self._thread = threading.Thread(target=self._run, name="weight-follower", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Follow no further event (does not block: the server's shutdown calls it first thing)."""
        self._stop.set()

    def stop(self, timeout: float = STOP_WAIT_S) -> bool:
        """Stop following and leave the group. False when the thread is still blocked in the group after
        `timeout` s: then the group is left alone (destroying it would wait for the blocked collective)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                return False
        self.receiver.close()
        return True

    def _join_fast_llm(self) -> bool:
        """Fast-LLM forms its broadcast group once, before its first weights_ready (rlkube.core.fast_llm_weights):
        join it first, retrying until it forms or we are stopped."""
        while not self._stop.is_set():
            try:
                self.receiver.join()
                log.info("joined Fast-LLM's weight broadcast as rank %d of %d", self.receiver.rank,
                         self.receiver.world_size)
                return True
            except WeightSyncError as exc:
                log.warning("%s; retrying", exc)
                self._stop.wait(1.0)
        return False

    def _run(self) -> None:
        if isinstance(self.receiver, FastLlmReceiver) and not self._join_fast_llm():
            return
        # From the newest weights_ready/training_finished already in the stream on. Redis may come up after us
        # (pods start together) or restart: the reader keeps reconnecting.
        reader = streams.EventReader(self.redis, self.keys.events, None, stop=self._stop,
                                     latest_of=(protocol.WEIGHTS_READY, protocol.TRAINING_FINISHED))
        try:
            for event in reader.follow(block_ms=EVENTS_BLOCK_MS, count=16):
                self.handle(event)
                if self.finished.is_set() or self._stop.is_set():
                    break
        except Exception:
            log.exception("weight follower stopped")

    def handle(self, event: protocol.TrainerEvent) -> None:
        if self._stop.is_set():
            return  # stopping: joining a group now could only block the exit
        if event.type == protocol.TRAINING_FINISHED:
            log.info("training_finished (%s): leaving the weight-update group; serving until SIGTERM",
                     event.stream_id)
            self.receiver.close()
            self.finished.set()
            return
        if event.type != protocol.WEIGHTS_READY:
            return
        epoch = event.payload.get("epoch")
        fast_llm = isinstance(self.receiver, FastLlmReceiver)
        if not fast_llm and not isinstance(epoch, str):
            log.warning("weights_ready %s has no `epoch`: not a native weight-sync trainer; ignored", event.stream_id)
            return
        t0 = time.monotonic()
        try:
            if fast_llm:
                # Fast-LLM announces, then broadcasts (streaming.py:99-116); its step is the version.
                version, state = event.step or 0, self.receiver.receive()
            elif epoch != self.receiver.epoch:
                log.info("joining weight-update epoch %s (was %s)", epoch, self.receiver.epoch)
                self.receiver.join(epoch)
            if not fast_llm:
                version, state = self.receiver.receive(adapters=True)
        except StaleEpoch as exc:
            log.info("%s", exc)
            return
        except WeightSyncError as exc:
            log.warning("weight update of %s failed: %s; waiting for the next announcement", event.stream_id, exc)
            return
        received = time.monotonic()
        model = copy.deepcopy(self.template)
        meta = (None if fast_llm else self.receiver.last_meta) or {}
        adapter = meta.get("kind") == ADAPTER
        try:
            if adapter:
                lora.merge_into(model, self.base, state, float(meta["adapter"]["scaling"]))
            else:
                # By HF name, converted to the served dtype; strict: a missing or extra tensor is an error
                # (docs/references.md §6.15).
                hf_state.load_weights(model, state, self.aliases)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            log.error("%s of version %d does not fit the model: %s; keeping version %d",
                      "the adapter" if adapter else "weights", version, exc, self.engine.policy.version)
            return
        # What is served, in the dtypes it travelled in: equals the trainer's checksum when nothing was lost (an
        # adapter: the adapter as received and verified). /health reads the checksum and the version without a
        # lock (another thread): the checksum is set first and the version last, so a reader that sees the new
        # version sees its checksum too.
        if adapter:
            self.served_checksum = self.receiver.last_checksum
        else:
            served = hf_state.named_weights(model)
            self.served_checksum = weights_checksum((n, t.to(state[n].dtype)) for n, t in served.items()
                                                    if n in state)
        self.engine.set_policy(model, version)
        self.updates += 1
        self.last_update_s = time.monotonic() - t0
        self.last_update_at = time.time()
        self.synced.set()
        log.info("%s version %d in effect (checksum %r, transfer %.3fs, load %.3fs)",
                 "adapter" if adapter else "weights", version, self.served_checksum, received - t0,
                 time.monotonic() - received)


class InferenceServer:
    """The aiohttp application around an engine and (optionally) a weight follower."""

    def __init__(self, engine: SamplingEngine, served: ServedModel, follower: WeightFollower | None):
        self.engine = engine
        self.served = served
        self.follower = follower
        self.requests = 0
        self.started = time.monotonic()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_shutdown.append(self.on_shutdown)
        return app

    async def on_shutdown(self, app: web.Application) -> None:
        """First step of the graceful shutdown (listening has stopped; in-flight requests are waited for next):
        no new weight update, and no request left waiting in the engine, so that wait is only the running batch."""
        if self.follower is not None:
            self.follower.request_stop()
        self.engine.shutdown()

    def healthy(self) -> bool:
        return self.follower is None or self.follower.synced.is_set()

    async def health(self, request: web.Request) -> web.Response:
        f = self.follower
        body = {
            "status": "ok" if self.healthy() else "waiting for the weight-update group",
            "model_version": self.engine.policy.version,
            "epoch": f.receiver.epoch if f else None,
            "updates": f.updates if f else 0,
            "last_update_s": f.last_update_s if f else None,
            "weights_checksum": f.served_checksum if f else None,
            "training_finished": f.finished.is_set() if f else False,
            "requests": self.requests,
        }
        return web.json_response(body, status=200 if self.healthy() else 503, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.served), dumps=_dumps)

    async def completions(self, request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json(loads=orjson.loads)
            except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not JSON: {exc}") from None
            req = parse_completion_request(body, self.served)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status, dumps=_dumps)
        self.requests += 1
        try:
            result = await asyncio.wrap_future(self.engine.submit(req))
        except EngineStopped as exc:
            error = RequestError(str(exc), status=503, type_="server_shutting_down")
            return web.json_response(error.body(), status=503, dumps=_dumps)
        if req.stream:
            # One batch samples the whole request: its chunks all come at the end (see rlkube.core.openai_api).
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
            for chunk in StreamChunks(req, self.served).of_result(result):
                await response.write(sse(chunk))
            await response.write(SSE_DONE)
            await response.write_eof()
            return response
        return web.json_response(completion_response(req, result, self.served), dumps=_dumps)


def _check_engine(engine: str) -> None:
    if engine not in ("native", "vllm"):
        raise SystemExit(f"spec.inference.engine: unknown engine {engine!r} (known: native, vllm)")


def build_server(ctx: RoleContext) -> tuple[InferenceServer, WeightFollower]:
    spec = ctx.spec
    model_dir = materialize_model(spec.model, ctx.model_cache_dir)
    model = load_model(model_dir, spec.model.dtype)
    tokenizer = load_tokenizer(model_dir, model.config)
    check_sequence_length(model.config, spec.model.max_sequence_length)
    engine = SamplingEngine(model, tokenizer, version=0, seed=spec.model.seed * 1000 + ctx.index)
    served = ServedModel(spec.model.path, tokenizer, spec.model.max_sequence_length)
    if not ctx.weight_sync_addr:
        raise SystemExit(f"{runtime.ENV_WEIGHT_SYNC} is not set: the inference server must join the trainer's "
                         "weight-update group")
    if spec.trainer.backend == "fast-llm":
        # Fast-LLM's broadcast, not ours: its rendezvous, ranks, backend and wire (rlkube.core.fast_llm_weights).
        receiver = FastLlmReceiver(ctx.weight_sync_addr, rank=ctx.weight_sync_rank(),
                                   world_size=fast_llm_rendezvous.world_size(spec), timeout_s=fast_llm_rendezvous.RECEIVER_TIMEOUT_S,
                                   backend=fast_llm_rendezvous.broadcast_backend(spec), local_host=ctx.bind_host)
    else:
        receiver = WeightReceiver(ctx.weight_sync_addr, rank=ctx.weight_sync_rank(),
                                  world_size=ctx.weight_sync_world_size,
                                  timeout_s=RECEIVE_TIMEOUT_S, local_host=ctx.bind_host)
    client = redis.Redis.from_url(ctx.redis_url, socket_timeout=30, health_check_interval=30)
    follower = WeightFollower(client, ctx.keys, receiver, engine, copy.deepcopy(model))
    return InferenceServer(engine, served, follower), follower


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inference %(levelname)s %(message)s")
    ctx = RoleContext.from_env()
    _check_engine(ctx.spec.inference.engine)
    if ctx.spec.inference.engine == "vllm":
        # Only a vllm server loads it: it may re-execute itself under another interpreter (RLKUBE_VLLM_PYTHON).
        from rlkube.core import vllm_server

        return vllm_server.main()
    # Three threads share the GIL (HTTP loop, sampling, weight follower). With the default 5 ms switch interval
    # the follower waits that long at every hand-over while sampling runs Python, and the trainer, blocked in
    # the broadcast, waits with it.
    sys.setswitchinterval(0.001)
    server, follower = build_server(ctx)  # a bad model directory raises ModelError: run_role reports it
    server.engine.start()
    follower.start()
    port = ctx.port or runtime.INFERENCE_PORT
    log.info("native inference for %s on %s:%d (rank %d of %d in the weight-update group)", server.served.name,
             ctx.bind_host, port, ctx.weight_sync_rank(), ctx.weight_sync_world_size)
    # run_app turns SIGTERM/SIGINT into a graceful shutdown (InferenceServer.on_shutdown first) and returns.
    web.run_app(server.app(), host=ctx.bind_host, port=port, print=None, shutdown_timeout=HTTP_SHUTDOWN_S,
                access_log=None)
    log.info("stopping")
    left_group = follower.stop(STOP_WAIT_S)
    sampler_done = server.engine.stop(STOP_WAIT_S)
    if not (left_group and sampler_done):
        # A thread still blocked in the weight-update group (or a torch batch still running) would make the
        # interpreter's exit wait for, or crash on, it (see the module docstring): leave without that.
        log.warning("exiting now: %s", "the weight follower is blocked in the weight-update group (the trainer "
                    "neither completes the rendezvous nor sends)" if not left_group else "a batch is still running")
        logging.shutdown()
        os._exit(0)
    log.info("stopped")
    # Nothing is left to flush but the logs: skip the interpreter's teardown, which with torch and transformers
    # loaded takes 1-2 s on a busy machine, time the teardown grace period does not need to spend.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    from rlkube.core.errors import run_role

    sys.exit(run_role(main))
