"""The one-GPU smoke check's engine in its own process (rlkube.bench.gpu_smoke, step 3): a publisher that hands
the trainer's weights straight to the native engine's WeightFollower, and the engine's HTTP server on a loopback
port with a client.

Why in-process: the weight-sync group (NCCL between two processes) needs a GPU per side, so on one GPU the smoke
check cannot cross it; everything on both sides of it (the FSDP weight stream, packing, checksums, the
follower's load) still runs as the project's own code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from rlkube.local.ports import free_port


# --- the in-process weight update ----------------------------------------------------------------------------


class InProcessReceiver:
    """What rlkube.core.inference.native_engine.NativeEngine asks of its WeightReceiver, fed by InProcessPublisher."""

    epoch = "in-process"
    joined = True
    rank, world_size = 1, 2

    def __init__(self) -> None:
        self.pending: tuple[int, dict] | None = None
        self.last_checksum: float | None = None
        self.last_meta: dict = {"kind": "full"}  # the trainer here publishes full weights (no spec.trainer.lora)

    def join(self, epoch: str) -> None:  # pragma: no cover - the follower joins only an unknown epoch
        raise AssertionError(f"in-process update: unexpected epoch {epoch}")

    def receive(self, adapters: bool = False):
        update, self.pending = self.pending, None
        if update is None:
            raise RuntimeError("in-process update: nothing was published")
        return update

    def receive_streamed(self, load, adapters: bool = False, reuse: bool = False) -> int:
        """WeightReceiver.receive_streamed's shape: the update's tensors handed to `load` as one stream."""
        version, state = self.receive(adapters)
        self.receiving = self.last_meta
        load(iter(state.items()))
        return version

    def close(self) -> None:
        pass


class InProcessPublisher:
    """The trainer's Publisher (rlkube.core.trainer.publishers.Publisher) for an engine in the same process: the FSDP
    trainer hands it a StreamedWeights, whose passes it runs as rlkube.core.weights.publication.WeightPublisher does
    (`more(True)`, every bucket, `more(False)`), keeps the buckets instead of broadcasting them, unpacks and
    verifies them as WeightReceiver.receive does, then lets the engine's WeightFollower apply the update."""

    streams = True  # the trainer must not drain the stream itself: this publisher runs its passes
    rejoin_pending = False  # the engine is in this process: it never asks to rejoin

    def __init__(self, follower) -> None:
        self.follower = follower
        self.receiver: InProcessReceiver = follower.engine.receiver
        self.updates = 0
        self.bytes = 0
        self.seconds = 0.0

    def start(self, weights, version: int = 0, step: int | None = None, documents_seen: int = 0, **extra) -> None:
        self.publish(weights, version, version if step is None else step, documents_seen, **extra)

    def publish(self, weights, version: int, step: int, documents_seen: int = 0, **extra) -> None:
        from rlkube.contract import protocol
        from rlkube.core.weights.wire import (StreamedWeights, checksums_match, pack_weights, unpack_weights,
                                              weights_checksum)

        t0 = time.monotonic()
        if isinstance(weights, StreamedWeights):
            try:
                weights.more(True)
                buffers = list(weights.buckets())
            finally:
                weights.more(False)
            meta = weights.meta
        else:  # a replicated trainer hands named tensors
            packed = pack_weights(weights)
            meta, buffers = packed.meta, packed.buffers
        state = unpack_weights(meta, buffers)
        checksum = weights_checksum(state.items())
        if not checksums_match(checksum, float(meta["checksum"])):
            raise RuntimeError(f"in-process update of version {version}: checksum {checksum!r}, the trainer's "
                               f"{meta['checksum']!r}")
        self.bytes += sum(b.numel() * b.element_size() for b in buffers)
        self.receiver.pending = (int(version), state)
        self.receiver.last_checksum = checksum
        event = protocol.TrainerEvent(f"{self.updates}-0", protocol.WEIGHTS_READY,
                                      {"type": protocol.WEIGHTS_READY, "step": step, "version": int(version),
                                       "epoch": self.receiver.epoch, "checksum": meta["checksum"]})
        before = self.follower.updates
        self.follower.handle(event)
        if self.follower.updates != before + 1 or self.follower.engine.version != int(version):
            raise RuntimeError(f"the engine did not take version {version} (see the log above)")
        self.updates += 1
        self.seconds += time.monotonic() - t0

    def close(self) -> None:
        pass


# --- the engine behind its HTTP server -------------------------------------------------------------------------


class EngineClient:
    """rlkube.core.inference.shell.InferenceServer on a loopback port, in a thread of its own, and an HTTP client."""

    def __init__(self, server) -> None:
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        self._runner = None
        self._session = None

    def __enter__(self) -> EngineClient:
        import threading

        from aiohttp import ClientSession, ClientTimeout, web

        async def up():
            self._runner = web.AppRunner(self.server.app(), access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
            self._session = ClientSession(timeout=ClientTimeout(total=600))

        self.thread = threading.Thread(target=self.loop.run_forever, name="smoke-http", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(up(), self.loop).result(60)
        return self

    def __exit__(self, *exc) -> None:
        async def down():
            await self._session.close()
            await self._runner.cleanup()  # InferenceServer.on_shutdown: the engine stops taking requests

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(down(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        async def go():
            async with self._session.request(method, f"http://127.0.0.1:{self.port}{path}", json=body) as r:
                return r.status, await r.json()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(600)

    def complete(self, body: dict) -> dict:
        status, out = self._call("POST", "/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"/v1/completions answered {status}: {out}")
        return out

    def health(self) -> tuple[int, dict]:
        return self._call("GET", "/health")
