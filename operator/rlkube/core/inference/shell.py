"""The inference role's shell: one weight follower and one HTTP server over an engine (rlkube.core.inference.engine),
whichever `spec.inference.engine` names (native: rlkube.core.inference.native_engine; vllm:
rlkube.core.inference.vllm_engine).

An aiohttp server on RLKUBE_BIND_HOST:RLKUBE_PORT with POST /v1/completions, GET /v1/models and GET /health, the
same small OpenAI-compatible API for both engines (rlkube.core.inference.openai_api: request checks, response shape).

A background thread (`WeightFollower`) follows the trainer's events stream. On `weights_ready` it has the engine
join the group that sends the update when it holds no such group, receive and load the update, and put it in
effect; generation keeps going meanwhile (docs/references.md §6.4: the first update must not pause generation, so
requests are never gated on the update). When a group is joined is the engine's weight source's to say, chosen
once when the engine opens (rlkube.core.inference.weight_source): ours on an announced epoch that is new (leaving
the old), Fast-LLM's broadcast at start-up, again after a failed transfer, and when the trainer pod's launcher
announces a new broadcast store (`broadcast_opened`, a restarted trainer: it forms the group anew with every
receiver and waits for them in its constructor). /health answers 200
only once the engine is warm and the first update arrived over the group (so the server has joined it; the
trainer's start-up push makes that happen without any training step). An update that arrives but cannot be
served is counted in `rejected_updates` and the old version keeps serving; one that may have left the engine half
loaded stops the server with exit 1 (the restart brings a fresh one, which loads the model directory and rejoins). On
`training_finished` it leaves the group, as the trainer does on the same event (docs/references.md §6.5), and the
server keeps serving until SIGTERM, then exits 0.

SIGTERM must end the process within a teardown grace period (seconds) in every state, and the follower may be
blocked inside the group then: in the rendezvous of an announced epoch or in a receive that the trainer (alive,
frozen, or gone before its store answered) does not complete, for up to RECEIVE_TIMEOUT_S. Gloo cannot interrupt
that (ProcessGroupGloo.abort() does nothing), destroying the group waits for the blocked collective
(~ProcessGroupGloo joins its worker threads), and the interpreter's exit may wait for it too or abort in C++
teardown. So a follower still blocked after a short wait is left as it is, group included, and the process
leaves with os._exit. Requests get the same care: on shutdown the engine refuses those not yet sampled (503)
instead of holding the server's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import orjson
import redis
from aiohttp import web

from rlkube.contract import protocol, runtime, streams
from rlkube.contract.context import RoleContext
from rlkube.contract.weight_transport import TransportMismatch
from rlkube.core.errors import write_termination_message
from rlkube.core.inference.engine import Engine, UpdateRefused
from rlkube.core.inference.openai_api import (
    SSE_DONE,
    SSE_HEADERS,
    RequestError,
    StreamChunks,
    completion_response,
    models_response,
    parse_completion_request,
    sse,
)
from rlkube.core.inference.sampling import EngineStopped
from rlkube.core.weights.group import WeightSyncError

log = logging.getLogger("rlkube.inference")

ENGINES = ("native", "vllm")
EVENTS_BLOCK_MS = 200  # XREAD block of the follower: how soon it notices a stop while idle
# After SIGTERM: in-flight requests get HTTP_SHUTDOWN_S (only a running batch is left to finish, see above); the
# follower gets STOP_WAIT_S before it is left behind, then the engine stops its own (rlkube.core.inference.engine).
HTTP_SHUTDOWN_S = 1.0
STOP_WAIT_S = 0.5


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def newest_announcement(client: redis.Redis, stream: str, page: int = 200) -> protocol.TrainerEvent | None:
    """The newest BROADCAST_OPENED event in the events stream, None for none."""
    cursor = "+"
    while True:
        entries = client.xrevrange(stream, cursor, "-", count=page)
        for sid, fields in entries:
            event = protocol.decode_event(sid, fields)
            if event is not None and event.type == protocol.BROADCAST_OPENED:
                return event
        if len(entries) < page:
            return None
        cursor = "(" + protocol.text(entries[-1][0])


class WeightFollower:
    """Follows the events stream and puts every announced weight update in effect in the engine."""

    def __init__(self, client: redis.Redis | None, keys: protocol.StreamKeys, engine: Engine):
        self.redis = client
        self.keys = keys
        self.engine = engine
        self.synced = threading.Event()  # set once weights arrived over the group at least once
        self.finished = threading.Event()
        self.updates = 0
        self.rejected = 0  # updates that arrived (or failed arriving) after the group was joined, not served
        self.last_error: str | None = None
        self.last_update_s: float | None = None
        self.last_update_at: float | None = None
        # weights_checksum of the served weights in the transfer dtype, and where it comes from (engine.PARAMETERS
        # or RECEIVED).
        self.served_checksum: float | None = None
        self.checksum_source: str | None = None
        self.fatal: str | None = None  # why the served model is in an unknown state (the server exits 1)
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
        self.engine.leave()
        return True

    def _run(self) -> None:
        if not self.engine.source.start(self.engine, self._stop):
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
            if not self._stop.is_set():
                log.exception("weight follower stopped")

    def handle(self, event: protocol.TrainerEvent) -> None:
        if self._stop.is_set():
            return  # stopping: joining a group now could only block the exit
        if event.type == protocol.TRAINING_FINISHED:
            log.info("training_finished (%s): leaving the weight-update group; serving until SIGTERM",
                     event.stream_id)
            self.engine.leave()
            self.finished.set()
            return
        if event.type == protocol.BROADCAST_OPENED:
            self.engine.source.opened(self.engine, event, lambda: self._newest_announcement(event), self._stop)
            return
        if event.type != protocol.WEIGHTS_READY:
            return
        t0 = time.monotonic()
        try:
            if not self.engine.source.prepare(self.engine, event, self._stop):
                return
        except TransportMismatch as exc:
            # Trainer and engine disagree on the transport: a configuration error no rejoin can mend.
            log.critical("%s; exiting", exc)
            self.last_error = self.fatal = str(exc)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        try:
            update = self.engine.receive_announced(event.step or 0)
        except (WeightSyncError, UpdateRefused) as exc:
            self._refused(event, exc)
            return
        # What /health reports about the weights first, the version last: /health reads them without a lock
        # (another thread), so a reader that sees the new version sees its checksum too.
        self.served_checksum, self.checksum_source = update.checksum, update.checksum_source
        self.engine.apply(update)
        self.updates += 1
        self.last_update_s = time.monotonic() - t0
        self.last_update_at = time.time()
        self.synced.set()
        log.info("%s version %d in effect (checksum %r, transfer %.3fs, load %.3fs)",
                 "adapter" if update.adapter else "weights", update.version, update.checksum, update.transfer_s,
                 update.load_s)

    def _newest_announcement(self, event: protocol.TrainerEvent) -> protocol.TrainerEvent | None:
        """The newest BROADCAST_OPENED event in the stream (`event` itself when the stream cannot be read)."""
        try:
            return newest_announcement(self.redis, self.keys.events)
        except redis.exceptions.RedisError as exc:
            log.warning("reading the newest broadcast announcement: %s; acting on %s", exc, event.stream_id)
            return event

    def _refused(self, event: protocol.TrainerEvent, exc: Exception) -> None:
        self.rejected += 1
        self.last_error = str(exc)
        log.error("weight update of %s refused: %s; keeping version %d", event.stream_id, exc, self.engine.version)
        if isinstance(exc, UpdateRefused) and exc.fatal:
            # The model may be half loaded: serving it would sample from weights nobody trained.
            log.critical("the served model is in an unknown state; exiting")
            self.fatal = str(exc)
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.engine.source.transfer_failed(self.engine, self._stop)


class InferenceServer:
    """The aiohttp application around an engine and (optionally) a weight follower."""

    def __init__(self, engine: Engine, follower: WeightFollower | None):
        self.engine = engine
        self.served = engine.served
        self.follower = follower
        self.requests = 0
        self.stopping = False
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
        self.stopping = True
        if self.follower is not None:
            self.follower.request_stop()
        self.engine.shutdown()

    def healthy(self) -> bool:
        return self.engine.ready() and (self.follower is None or self.follower.synced.is_set())

    async def health(self, request: web.Request) -> web.Response:
        f = self.follower
        if not self.engine.ready():
            status = "warming up"
        elif not self.healthy():
            status = "waiting for the weight-update group"
        else:
            status = "ok"
        body = {
            "status": status,
            "engine": self.engine.name,
            "model_version": self.engine.version,
            "epoch": self.engine.epoch,
            "weight_sync_ranks": self.engine.ranks,
            "updates": f.updates if f else 0,
            "rejected_updates": f.rejected if f else 0,
            "last_error": f.last_error if f else None,
            "last_update_s": f.last_update_s if f else None,
            # Read back from the served parameters where the engine can (native; vLLM on GPUs), else the checksum
            # of what was loaded, verified against the trainer's before loading (vllm_worker.rlkube_served_checksum).
            "weights_checksum": f.served_checksum if f else None,
            "weights_checksum_source": f.checksum_source if f else None,
            "training_finished": f.finished.is_set() if f else False,
            "requests": self.requests,
        }
        return web.json_response(body, status=200 if self.healthy() else 503, dumps=_dumps)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.served), dumps=_dumps)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = await request.json(loads=orjson.loads)
            except (orjson.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not JSON: {exc}") from None
            req = parse_completion_request(body, self.served)
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status, dumps=_dumps)
        try:
            if self.stopping:
                raise EngineStopped("the inference server is shutting down")
            self.requests += 1
            if req.stream:
                # The first chunk before the response starts: a request refused by a stopping engine gets a 503.
                chunks = aiter(self.engine.stream(req, StreamChunks(req, self.served)))
                first = await anext(chunks, None)
            else:
                result = await self.engine.generate(req)
        except EngineStopped as exc:
            error = RequestError(str(exc), status=503, type_="server_shutting_down")
            return web.json_response(error.body(), status=503, dumps=_dumps)
        if not req.stream:
            return web.json_response(completion_response(req, result, self.served), dumps=_dumps)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        if first is not None:
            await response.write(sse(first))
            async for chunk in chunks:
                await response.write(sse(chunk))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response


async def open_engine(ctx: RoleContext) -> Engine:
    """The engine `spec.inference.engine` names, loaded, on the running event loop. Each engine module is imported
    only when named: vLLM's pulls in vllm, the native one the torch sampler."""
    if ctx.spec.inference.engine == "vllm":
        from rlkube.core.inference import vllm_engine

        return await vllm_engine.open_engine(ctx)
    from rlkube.core.inference import native_engine

    return native_engine.open_engine(ctx)


async def serve(ctx: RoleContext) -> str | None:
    """Serve until SIGTERM/SIGINT; the reason the served model is unusable when the follower found one, else None."""
    engine = await open_engine(ctx)  # a bad model directory raises ModelError: run_role reports it
    client = redis.Redis.from_url(ctx.redis_url, socket_timeout=30, health_check_interval=30)
    follower = WeightFollower(client, ctx.keys, engine)
    server = InferenceServer(engine, follower)
    runner = web.AppRunner(server.app(), access_log=None, shutdown_timeout=HTTP_SHUTDOWN_S)
    await runner.setup()
    port = ctx.port or runtime.INFERENCE_PORT
    await web.TCPSite(runner, ctx.bind_host, port).start()
    log.info("%s inference for %s on %s:%d (ranks %d-%d of %d in the weight-update group)", engine.name,
             server.served.name, ctx.bind_host, port, ctx.weight_sync_rank(),
             ctx.weight_sync_rank(ctx.spec.inference.tensor_parallel - 1), ctx.weight_sync_world_size)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    follower.start()
    await stop.wait()
    log.info("stopping")
    follower.request_stop()
    # Graceful: InferenceServer.on_shutdown first, then in-flight requests get HTTP_SHUTDOWN_S.
    await runner.cleanup()
    # The follower's stop may have to wait for the event loop (the vLLM engine's calls run on it): off the loop.
    left_group = await asyncio.to_thread(follower.stop, STOP_WAIT_S)
    still_running = await engine.close()
    if not left_group or still_running:
        # A thread still blocked in the weight-update group (or a batch still running) would make the
        # interpreter's exit wait for, or crash on, it (see the module docstring): leave without that.
        log.warning("exiting now: %s", "the weight follower is blocked in the weight-update group (the trainer "
                    "neither completes the rendezvous nor sends)" if not left_group else still_running)
    return follower.fatal


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inference %(levelname)s %(message)s")
    ctx = RoleContext.from_env()
    engine = ctx.spec.inference.engine
    if engine not in ENGINES:
        raise SystemExit(f"spec.inference.engine: unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    if engine == "vllm":
        # Before anything is loaded: it may re-execute this module under another interpreter (RLKUBE_VLLM_PYTHON).
        from rlkube.core.inference.vllm_engine import reexec_with_vllm_python

        reexec_with_vllm_python()
    if not ctx.weight_sync_addr:
        raise SystemExit(f"{runtime.ENV_WEIGHT_SYNC} is not set: the inference server must join the trainer's "
                         "weight-update group")
    fatal = asyncio.run(serve(ctx))
    log.info("stopped")
    if fatal:
        into = "vLLM" if engine == "vllm" else "the native engine"
        write_termination_message(f"a weight update could not be loaded into {into}: {fatal}")
    # Nothing is left to flush but the logs: skip the interpreter's teardown, which may wait for a follower
    # blocked in the group (see above) and with torch and transformers loaded takes 1-2 s on a busy machine, time
    # the teardown grace period does not need to spend.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if fatal else 0)
