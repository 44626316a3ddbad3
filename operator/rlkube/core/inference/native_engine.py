"""The native inference engine (`spec.inference.engine: native`) behind the inference shell
(rlkube.core.inference.shell): `SamplingEngine` (rlkube.core.inference.sampling, a KV cache) over the job's Hugging Face
model directory (the same directory the trainer starts from, materialized from `spec.model.path`), in
`spec.model.dtype`.

An update is received by this process's own receiver, the one of the weight source chosen at open
(rlkube.core.inference.weight_source: rlkube.core.weights.group.WeightReceiver for our group,
rlkube.core.weights.fast_llm.FastLlmReceiver for Fast-LLM's broadcast) as HF names in the transfer dtype, loaded by
name into a copy of the model (converted to the served dtype) and swapped in; generation keeps going meanwhile.
Both are streamed: each bucket (Fast-LLM: each tensor) is copied into the copy's parameters as it arrives
(`receive_streamed`), so an update costs the copy plus one bucket. A LoRA job's update is the
adapter alone (kind "lora-adapter", rlkube.core.weights): the engine serves base + adapter by setting
W = W0 + scaling x B @ A for each adapted weight of the copy, W0 from the base it loaded at start
(rlkube.core.training.lora.merge_into), so sampling costs what it costs without LoRA and the update moves only the
adapter's bytes. The served checksum is read back from the copy's parameters (an adapter's: the adapter as received and
verified).
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from rlkube.contract import fast_llm_rendezvous, weight_transport
from rlkube.contract.context import RoleContext
from rlkube.core.training import lora
from rlkube.core.weights.fast_llm import FastLlmReceiver
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import check_sequence_length, load_model, load_tokenizer
from rlkube.core.hf.source import materialize_model
from rlkube.core.inference.engine import PARAMETERS, RECEIVE_TIMEOUT_S, RECEIVED, Engine, Received, UpdateRefused
from rlkube.core.inference.weight_source import FastLlmBroadcast, WeightSource, weight_source
from rlkube.core.inference.openai_api import ServedModel, StreamChunks
from rlkube.core.inference.sampling import GenerationRequest, GenerationResult, SamplingEngine
from rlkube.core.weights.group import WeightReceiver
from rlkube.core.weights.wire import ADAPTER, weights_checksum

STOP_WAIT_S = 0.5  # the running batch's time to finish after SIGTERM, then it is left behind


class NativeEngine(Engine):
    """A SamplingEngine and the receiver its updates come through."""

    name = "native"

    def __init__(self, sampler: SamplingEngine, receiver: WeightReceiver | FastLlmReceiver,
                 template: torch.nn.Module, served: ServedModel | None = None, source: WeightSource | None = None):
        self.sampler = sampler
        self.receiver = receiver  # the source's: ours, or Fast-LLM's (both receive streamed, by HF name)
        self.served = served
        self.source = source if source is not None else WeightSource()
        self.template = template  # the model a received update is loaded into (a copy of it per update)
        # The base weights W0 an adapter update is merged onto (the template is never changed: no copy needed).
        self.base = dict(template.named_parameters())
        self.ranks = [receiver.rank]
        self.world_size = receiver.world_size

    def ranks_text(self) -> str:
        return f"rank {self.ranks[0]}"  # one process, one rank (the log line e2e tests and users read)

    @property
    def version(self) -> int:
        return self.sampler.policy.version

    @property
    def epoch(self) -> str | None:
        return self.receiver.epoch

    @property
    def joined(self) -> bool:
        return self.receiver.joined

    @property
    def fast_llm_generation(self) -> str | None:
        return getattr(self.receiver, "generation", None)

    def join_broadcast(self, stop: threading.Event) -> bool:
        self.receiver.join()
        return True

    def join(self, epoch: str) -> None:
        self.receiver.join(epoch)

    def receive_announced(self, step: int) -> Received:
        """The announced update, each bucket (Fast-LLM's: each tensor) copied into a copy of the model as it arrives
        (WeightReceiver.receive_streamed, FastLlmReceiver.receive_streamed): the copy is what generation swaps to,
        so sampling never sees a half-loaded model; the update itself costs one bucket beside it. An adapter
        (small) is kept whole for the merge. Versioned as the update says, or by `step` where the wire carries no
        version (Fast-LLM's)."""
        t0 = time.monotonic()
        model = copy.deepcopy(self.template)
        targets = hf_state.named_weights(model)
        arrived: dict[str, torch.dtype] = {}
        adapter_state: dict[str, torch.Tensor] = {}
        failed: list[Exception] = []

        def load(stream) -> None:
            if (self.receiver.receiving or {}).get("kind") == ADAPTER:
                adapter_state.update((name, t.clone()) for name, t in stream)
                return
            try:
                # By HF name, converted to the served dtype; strict: a missing or extra tensor is an error
                # (docs/references.md §6.15).
                arrived.update(hf_state.copy_into(targets, stream))
            except (RuntimeError, KeyError, ValueError, TypeError) as exc:
                failed.append(exc)
                for _ in stream:  # the rest of the update, so the group stays in step
                    pass

        carried = self.receiver.receive_streamed(load, adapters=True, reuse=True)
        version = step if carried is None else carried
        meta = self.receiver.last_meta or {}
        received = time.monotonic()
        adapter = meta.get("kind") == ADAPTER
        try:
            if failed:
                raise failed[0]
            if adapter:
                lora.merge_into(model, self.base, adapter_state, float(meta["adapter"]["scaling"]))
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise UpdateRefused(f"{'the adapter' if adapter else 'weights'} of version {version} does not fit the "
                                f"model: {exc}") from exc
        if adapter:
            checksum, source = self.receiver.last_checksum, RECEIVED
        else:
            # What is served, in the dtypes it travelled in: equals the trainer's checksum when nothing was lost.
            checksum = weights_checksum((n, t.to(arrived[n])) for n, t in targets.items() if n in arrived)
            source = PARAMETERS
        return Received(version=version, adapter=adapter, checksum=checksum, checksum_source=source,
                        transfer_s=received - t0, load_s=0.0, loaded=model)

    def apply(self, update: Received) -> None:
        self.sampler.set_policy(update.loaded, update.version)

    def leave(self) -> None:
        self.receiver.close()

    def start(self) -> None:
        self.sampler.start()

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        return await asyncio.wrap_future(self.sampler.submit(req))

    async def stream(self, req: GenerationRequest, chunks: StreamChunks) -> AsyncIterator[dict[str, Any]]:
        # One batch samples the whole request: its chunks all come at the end (see rlkube.core.inference.openai_api).
        for chunk in chunks.of_result(await self.generate(req)):
            yield chunk

    def shutdown(self) -> None:
        self.sampler.shutdown()

    async def close(self) -> str | None:
        done = await asyncio.to_thread(self.sampler.stop, STOP_WAIT_S)
        return None if done else "a batch is still running"


def weight_receiver(ctx: RoleContext) -> WeightReceiver:
    """This engine's receiver of the trainer's group: the transport from the one rule (rlkube.contract.
    weight_transport; this engine samples on the CPU, or on the trainer's GPU when colocated with it), the dtype it
    serves expected for `auto`."""
    spec = ctx.spec
    return WeightReceiver(ctx.weight_sync_addr, rank=ctx.weight_sync_rank(), world_size=ctx.weight_sync_world_size,
                          timeout_s=RECEIVE_TIMEOUT_S, local_host=ctx.bind_host,
                          backend=weight_transport.receiver_transport(spec, weight_transport.engine_device(spec)),
                          transfer_dtype=weight_transport.transfer_dtype_name(spec))


def broadcast_receiver(ctx: RoleContext) -> FastLlmReceiver:
    """This engine's receiver of Fast-LLM's broadcast: its rendezvous, ranks, backend and wire
    (rlkube.core.weights.fast_llm)."""
    spec = ctx.spec
    return FastLlmReceiver(ctx.weight_sync_addr, rank=ctx.weight_sync_rank(),
                           world_size=fast_llm_rendezvous.world_size(spec),
                           timeout_s=fast_llm_rendezvous.broadcast_timeout_s(spec),
                           backend=fast_llm_rendezvous.broadcast_backend(spec), local_host=ctx.bind_host)


def open_engine(ctx: RoleContext) -> NativeEngine:
    """The job's model loaded for sampling, and the receiver of its trainer's updates (not joined yet)."""
    spec = ctx.spec
    model_dir = materialize_model(spec.model, ctx.model_cache_dir)
    device = weight_transport.engine_device(spec)
    if device == "cuda":
        # Colocated on the trainer's GPU (spec.inference.placement): this engine keeps to its share of the memory.
        torch.cuda.set_per_process_memory_fraction(spec.inference.device_memory_fraction)
    model = load_model(model_dir, spec.model.dtype, device=device)
    tokenizer = load_tokenizer(model_dir, model.config)
    check_sequence_length(model.config, spec.model.max_sequence_length)
    sampler = SamplingEngine(model, tokenizer, version=0, seed=spec.model.seed * 1000 + ctx.index)
    served = ServedModel(spec.model.path, tokenizer, spec.model.max_sequence_length)
    source = weight_source(spec)  # chosen once: the receiver is that source's
    receiver = broadcast_receiver(ctx) if isinstance(source, FastLlmBroadcast) else weight_receiver(ctx)
    # Three threads share the GIL (HTTP loop, sampling, weight follower). With the default 5 ms switch interval
    # the follower waits that long at every hand-over while sampling runs Python, and the trainer, blocked in
    # the broadcast, waits with it.
    sys.setswitchinterval(0.001)
    return NativeEngine(sampler, receiver, copy.deepcopy(model), served, source)
