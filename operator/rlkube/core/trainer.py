"""The trainer: the docs/design.md §6 API (`Trainer`) and the trainer ROLE (`python -m rlkube.core.trainer`).

`Trainer` is backend-independent: it loads the job's Hugging Face model directory (materialized from
`spec.model.path`) into the backend, turns documents into micro-batches by a token budget
(`spec.trainer.microBatchTokens`), accumulates their gradients normalised by the step's loss-token count, steps the
optimizer, writes checkpoints that are HF directories, and hands the weights (HF names) to a publisher. The role around it reads the job's training documents from Redis (Fast-LLM's consumer-group
protocol), trains `samplesPerStep` documents per step, and reports on the job's events stream:

    weights_ready (at start, then after every step; announce BEFORE the transfer)  ->  metrics (every step)
    checkpoint_saved (every intervalSteps and at the end)  ->  training_finished (last, see below)

`training_finished` is published only after the final checkpoint is durable and the weight-update group is
closed; on SIGTERM the trainer finishes the current step, checkpoints, and publishes it with interrupted=true
(like Fast-LLM); on an exception it publishes nothing and exits non-zero, so the operator never mistakes a crash
for completion (docs/references.md §6.3).

Two ways the trainer could otherwise hang past its grace period: a weight transfer waits for every inference
rank (up to gloo's 300 s when one never joins or died), so transfers run on a worker thread that SIGTERM stops
waiting for (the step is checkpointed and reported interrupted, the process exits without joining the thread);
and documents that stop coming: like Fast-LLM, the trainer gives up after RLKUBE_DOCUMENT_TIMEOUT_S (600 s)
without one, checkpoints what it trained and exits 1 without training_finished.

A restarted trainer resumes from the newest checkpoint in its directory. When its launcher saw a newer one saved
(RLKUBE_RESUME_CHECKPOINT) it exits 78 naming spec.trainer.checkpoint.claimName instead: the checkpoint volume was
lost (an emptyDir with its pod), and starting over would silently drop the job's progress
(rlkube.contract.checkpoint_loss).

With more than one rank (spec.trainer.nodes x processes per node; torch and megatron backends) one trainer
process runs per rank, data-parallel (several per pod through rlkube.core.launcher; see
rlkube.core.backends.torch_distributed): each rank reads its share of samplesPerStep documents per step as its own consumer
`fast_llm_consumer_{rank}`, the gradients are summed over the ranks (normalised by the step's global loss-token
count, so the result is single-process training on the union of the step's documents), and every rank steps.
Rank 0 alone loads checkpoints (then broadcasts weights, optimizer state and counters), writes checkpoints,
transfers weights to inference, and publishes events; the other ranks exit 0 once rank 0 has finished. SIGTERM
(to any rank) stops all ranks after the same step; a rank that dies makes the others exit 1 within
RLKUBE_COLLECTIVE_TIMEOUT_S, without training_finished.

With megatron's tensor parallelism (spec.trainer.megatron.tensorParallel = TP) the ranks form ranks / TP data-
parallel replicas of TP ranks each (`DataParallel.use_layout`): tensor-parallel rank 0 of replica r reads its share
as `fast_llm_consumer_{r}` and hands the documents to its peers; counts, statistics and gradients are summed over
the replicas only. Every rank holds a part of every weight, so weights, checkpoints and the start-up sync are
collectives (`Trainer.collective`, as for FSDP): every rank gathers, rank 0 alone sends and writes.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any, Protocol

import redis
import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.core import checkpoint as ckpt
from rlkube.core import lora
from rlkube.contract import protocol, runtime, streams
from rlkube.core.backends import TrainerBackend, build_backend
from rlkube.core.backends.torch_distributed import DataParallel, DistConfig, PeerLost
from rlkube.core.batch import Batch, collate, plan_micro_batches
from rlkube.core.errors import ConfigError, write_termination_message
from rlkube.core.hf.source import materialize_model
from rlkube.core.losses import LossStats
from rlkube.core.roles import stop_on_signals
from rlkube.core.weightsync import WeightPublisher, transfer_dtype
from rlkube.contract.context import RoleContext
from rlkube.contract import checkpoint_loss
from rlkube.contract.parallel import processes_per_node, trainer_world_size

log = logging.getLogger("rlkube.trainer")

READ_BLOCK_MS = 1000  # Fast-LLM's XREADGROUP block; also how often a waiting trainer checks for SIGTERM
ENV_DOCUMENT_TIMEOUT = "RLKUBE_DOCUMENT_TIMEOUT_S"
DEFAULT_DOCUMENT_TIMEOUT_S = 600.0  # Fast-LLM gives up after this long without a document


def document_timeout_from_env(env) -> float:
    """Seconds without a training document after which the trainer gives up (exit 1, no training_finished)."""
    raw = env.get(ENV_DOCUMENT_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_DOCUMENT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_DOCUMENT_TIMEOUT}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{ENV_DOCUMENT_TIMEOUT}={raw!r} must be > 0 seconds")
    return value


# --- weight publication ---------------------------------------------------------------------------


class Publisher(Protocol):
    """What the trainer needs from weight publication (rlkube.core.weightsync.WeightPublisher has this shape)."""

    def start(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int = 0, step: int | None = None,
              documents_seen: int = 0, **extra: Any) -> None: ...

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, step: int,
                documents_seen: int = 0, **extra: Any) -> None: ...

    def close(self) -> None: ...


class AnnounceOnly:
    """Publishes `weights_ready` without transferring anything: for a trainer with no weight-update group
    (RLKUBE_WEIGHT_SYNC_ADDR unset), e.g. when inference loads checkpoints itself, or in tests."""

    def __init__(self, client: redis.Redis, keys: protocol.StreamKeys):
        self.redis, self.keys = client, keys

    def start(self, named_tensors, version: int = 0, step: int | None = None, documents_seen: int = 0,
              **extra: Any) -> None:
        self.publish(named_tensors, version, version if step is None else step, documents_seen, **extra)

    def publish(self, named_tensors, version: int, step: int, documents_seen: int = 0, **extra: Any) -> None:
        self.redis.xadd(self.keys.events, protocol.weights_ready(step, documents_seen, version=int(version), **extra))

    def close(self) -> None:
        pass


# --- the trainer API ------------------------------------------------------------------------------


class Trainer:
    """docs/design.md §6: forward_backward / optim_step / save_checkpoint / publish_weights."""

    def __init__(
        self,
        spec: TrainingJobSpec,
        checkpoint_dir: Path | None = None,
        publisher: Publisher | None = None,
        backend: TrainerBackend | None = None,
        device: str = "cpu",
        micro_batch_tokens: int | None = None,
        dp: DataParallel | None = None,
        model_dir: Path | None = None,
    ):
        self.spec = spec
        # The job's model directory: the initial weights, and the config/tokenizer files of every checkpoint.
        self.model_dir = Path(model_dir) if model_dir is not None else materialize_model(spec.model)
        self.backend = backend or build_backend(spec, self.model_dir, device=device)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.publisher = publisher
        # The step's gradient is the same for any budget (up to float rounding); it bounds activation memory.
        self.micro_batch_tokens = micro_batch_tokens or spec.trainer.micro_batch_tokens
        self.dp = dp  # None: one process; else gradients and counts are summed over the data-parallel ranks
        if dp is not None and self.backend.parallel_layout is not None:
            dp.use_layout(self.backend.parallel_layout)  # model parallelism: sums over the data-parallel replicas only
        self._resumed_state: tuple[dict, dict | None] | None = None  # collective backends: what rank 0 resumed
        self.step = 0  # optimizer steps taken; weights after step N are policy version N
        self.documents_seen = 0
        self.last_checkpoint: tuple[int, Path] | None = None
        self._pending = LossStats()  # statistics of the gradients accumulated since the last optim_step
        self._pending_normalizer = 0.0
        self._publications = 0  # sharded: weight publications so far (unique rendezvous tags)
        self.last_stream = None  # sharded: the last publication's StreamedWeights (its peak_bytes)

    @property
    def sharded(self) -> bool:
        """The backend shards the model over the ranks (FSDP): whole-model operations are collectives."""
        return self.backend.shards_gradients

    @property
    def collective(self) -> bool:
        """Whole-model operations (weights, state, checkpoints) are collectives of every rank: a sharded backend,
        or one with tensor parallelism (megatron), whose ranks each hold a part of every weight."""
        return self.sharded or self.backend.collective_weights

    @property
    def version(self) -> int:
        return self.step

    @property
    def model(self) -> torch.nn.Module:
        return self.backend.model

    def make_batch(self, docs: Sequence[protocol.Document]) -> Batch:
        return collate(docs, pad_id=self.backend.pad_id, max_length=self.backend.max_sequence_length)

    def micro_batches(self, docs: Sequence[protocol.Document]) -> list[Batch]:
        """The documents as padded micro-batches within the token budget (similar lengths together)."""
        plans = plan_micro_batches([len(d.tokens) for d in docs], self.micro_batch_tokens)
        return [self.make_batch([docs[i] for i in plan]) for plan in plans]

    def forward_backward(self, batch: Batch | Sequence[protocol.Document], normalizer: float | None = None) -> dict[str, float]:
        """Accumulate the gradient of `batch`'s loss (sum over loss tokens / `normalizer`, default: the batch's
        own loss-token count), micro-batch by micro-batch. Pass the whole step's loss-token count when a step is
        split over several calls."""
        micro = batch.split_by_tokens(self.micro_batch_tokens) if isinstance(batch, Batch) else self.micro_batches(batch)
        return self._accumulate(micro, normalizer)

    def _accumulate(self, micro: Sequence[Batch], normalizer: float | None) -> dict[str, float]:
        total = sum(m.num_loss_tokens for m in micro)
        norm = float(normalizer) if normalizer is not None else float(max(total, 1))
        stats = LossStats()
        for m in micro:
            stats = stats.merge(self.backend.forward_backward(m, norm))
        if self.sharded and self.dp is not None:
            # FSDP's gathers and reduce-scatters are collectives: every rank runs as many passes as the busiest.
            for _ in range(int(self.dp.max(len(micro))) - len(micro)):
                self.backend.forward_backward_nothing()
        self._pending = self._pending.merge(stats)
        self._pending_normalizer = norm
        return stats.metrics(norm)

    def optim_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients (after the step). Returns grad_norm, policy_version and the loss
        statistics of everything accumulated since the previous step (summed over the data-parallel ranks)."""
        if self.dp is not None:
            names = [f.name for f in dataclass_fields(LossStats)]
            pending = [getattr(self._pending, n) for n in names]
            # A sharded backend reduce-scattered its gradients already (summed, torch_fsdp): only the statistics.
            summed = (self.dp.sum(pending) if self.sharded
                      else self.dp.sum_gradients(self.backend.gradient_parameters(), pending))
            reduced = dict(zip(names, summed, strict=True))
            for name, how in LossStats.EXTREMA.items():  # a min or max, not a sum (rlkube.core.losses)
                sign = -1.0 if how == "min" else 1.0
                reduced[name] = sign * self.dp.max(sign * getattr(self._pending, name))
            self._pending = LossStats(**reduced)
        lr = self.backend.learning_rate
        grad_norm = self.backend.optim_step()
        self.step += 1
        metrics = self._pending.metrics(self._pending_normalizer or None)
        self._pending, self._pending_normalizer = LossStats(), 0.0
        return {**metrics, "grad_norm": grad_norm, "lr": lr, "policy_version": self.version, "step": self.step}

    def train_step(self, docs: Sequence[protocol.Document]) -> dict[str, float]:
        """One optimizer step on `docs`: micro-batched forward/backward normalised over the whole step (with data
        parallelism: `docs` are this rank's share, normalised by the loss-token count of every rank's share)."""
        micro = self.micro_batches(docs)
        loss_tokens, n_docs = sum(m.num_loss_tokens for m in micro), len(docs)
        if self.dp is not None:
            loss_tokens, n_docs = self.dp.sum([loss_tokens, n_docs])
        self._accumulate(micro, normalizer=max(loss_tokens, 1))
        self.documents_seen += int(n_docs)
        return self.optim_step()

    def sync_from_leader(self) -> None:
        """Data parallelism: every rank takes rank 0's weights, optimizer state and counters (after rank 0 resumed
        from its checkpoint, or fresh), so all ranks start identical however they were initialised."""
        if self.dp is None or self.sharded:
            # Sharded: every rank loaded the same initial weights and resumes from the distributed checkpoint.
            return
        # Loading a model takes each rank its own time (minutes for a large one): meet in the alive-checked
        # rendezvous, not in the broadcast below, which fails after the collective timeout.
        self.dp.gather("model-loaded")
        if self.collective:
            # Tensor parallel: rank 0 holds only its shards; every rank loaded the job's directory, and takes its
            # own shards of what rank 0 resumed from (the checkpoint's full tensors), if it resumed.
            resumed, step, documents_seen = self.dp.broadcast_state(
                (self._resumed_state, self.step, self.documents_seen) if self.dp.is_leader else None)
            if resumed is not None and not self.dp.is_leader:  # rank 0 loaded it when it resumed
                self.backend.load_state(*resumed)
            self._resumed_state = None
            self.step, self.documents_seen = step, documents_seen
            return
        state = None
        if self.dp.is_leader:
            model_state, optim_state = self.backend.state()
            state = (model_state, optim_state, self.step, self.documents_seen)
        model_state, optim_state, step, documents_seen = self.dp.broadcast_state(state)
        if not self.dp.is_leader:
            self.backend.load_state(model_state, optim_state)
            self.step, self.documents_seen = step, documents_seen

    # --- checkpoints ---

    def save_checkpoint(self, step: int | None = None) -> Path | None:
        """Rank 0 writes the checkpoint (returns its path); with a collective backend every rank must call this,
        and the others return None."""
        step = self.step if step is None else step
        tensor_parallel_peer = self.collective and not self.sharded and self.dp is not None and not self.dp.is_leader
        if self.checkpoint_dir is None and not tensor_parallel_peer:
            raise RuntimeError("no checkpoint directory (RLKUBE_CHECKPOINT_DIR) configured")
        if self.sharded:
            return self._save_sharded_checkpoint(step)
        model_state, optim_state = self.backend.state()  # a collective with tensor parallelism
        if tensor_parallel_peer:
            self.last_checkpoint = (step, None)  # it took part in rank 0's checkpoint
            return None
        extra: dict[str, Any] = {"backend": self.spec.trainer.backend}
        write_weights = None
        if self.spec.trainer.lora is not None:  # PEFT's adapter directory instead of the weights (core/checkpoint)
            extra["adapter"] = "peft-lora"

            def write_weights(directory: Path) -> None:
                lora.write_adapter(directory, self.backend.model, model_state)

        meta = ckpt.CheckpointMeta(step=step, documents_seen=self.documents_seen, weights_version=self.version,
                                   extra=extra)
        path = ckpt.save_checkpoint(self.checkpoint_dir, meta, model_state, optim_state, model_dir=self.model_dir,
                                    dtype=self.spec.model.dtype, write_weights=write_weights)
        self.last_checkpoint = (step, path)
        return path

    def _save_sharded_checkpoint(self, step: int) -> Path:
        """COLLECTIVE (every rank, one checkpoint directory they all see): each rank writes its shards of weights
        and Adam state (torch.distributed.checkpoint) to `shards-{step}`, then rank 0 writes `step-{step}` as for
        the replicated backends (a Hugging Face directory of the gathered weights; optimizer.pt holds the LR
        schedule and marks the optimizer state as distributed), whose atomic rename completes both."""
        root = self.checkpoint_dir
        shards = root / ckpt.shards_name(step)
        self.backend.save_distributed(shards)
        model_state, optim_state = self.backend.full_state()
        path = root / ckpt.checkpoint_name(step)
        if self.dp is None or self.dp.is_leader:
            extra: dict[str, Any] = {"backend": self.spec.trainer.backend, "sharding": "fsdp"}
            write_weights = None
            if self.spec.trainer.lora is not None:  # PEFT's adapter directory from the gathered adapter
                extra["adapter"] = "peft-lora"
                write_weights = functools.partial(lora.write_adapter, peft_model=self.backend.model,
                                                  state=model_state)
            meta = ckpt.CheckpointMeta(step=step, documents_seen=self.documents_seen, weights_version=self.version,
                                       extra=extra)
            path = ckpt.save_checkpoint(root, meta, model_state, optim_state, model_dir=self.model_dir,
                                        dtype=self.spec.model.dtype, write_weights=write_weights)
        del model_state
        self.last_checkpoint = (step, path)
        return path

    def _resume_sharded(self, path: Path) -> None:
        meta = ckpt.read_meta(path)
        shards = path.parent / ckpt.shards_name(meta.step)
        if self.spec.trainer.lora is not None or meta.extra.get("adapter"):
            # The shards hold the adapter and its Adam state; the adapter directory beside them must be there and
            # fit the spec as for an unsharded resume (ConfigError otherwise, never a fresh adapter in silence).
            self._adapter_reader(path, meta)(path)
        if meta.extra.get("sharding") == "fsdp" and shards.is_dir():
            self.backend.load_distributed(shards)  # at any world size
        else:
            raise RuntimeError(f"{path}: no distributed checkpoint {shards.name} next to it (resuming a sharded "
                               "trainer from a replicated checkpoint is not implemented)")
        self.step, self.documents_seen = meta.step, meta.documents_seen
        self.last_checkpoint = (meta.step, path)
        log.info("resumed from %s (step %d, %d documents seen; sharded)", path, meta.step, meta.documents_seen)

    def resume(self) -> Path | None:
        """Load the newest complete checkpoint, if any; returns its path."""
        if self.checkpoint_dir is None:
            return None
        path = ckpt.latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        if self.sharded:
            self._resume_sharded(path)
            return path
        # Weights are HF-named whatever the backend; optimizer state is the writing backend's own layout.
        found = ckpt.read_meta(path) or ckpt.CheckpointMeta(0)
        written_by = found.extra.get("backend")
        read_weights = self._adapter_reader(path, found)
        same_backend = written_by in (None, self.spec.trainer.backend)
        if not same_backend:
            log.warning("checkpoint %s was written by the %s backend: loading its weights, not its optimizer state",
                        path, written_by)
        load = self.backend.load_state
        if self.collective and self.dp is not None:
            # tensor parallel: sync_from_leader hands the full tensors to every rank, which load their shards
            def load(model_state, optim_state):
                self._resumed_state = ({k: v.clone() for k, v in model_state.items()}, optim_state)
                self.backend.load_state(model_state, optim_state)
        meta = ckpt.load_checkpoint_state(path, load, with_optimizer=same_backend, read_weights=read_weights)
        self.step, self.documents_seen = meta.step, meta.documents_seen
        self.last_checkpoint = (meta.step, path)
        log.info("resumed from %s (step %d, %d documents seen)", path, meta.step, meta.documents_seen)
        return path

    def _adapter_reader(self, path: Path, meta: ckpt.CheckpointMeta):
        """How to read `path`'s model state: a LoRA job resumes from an adapter checkpoint only, and a full-weight
        job from a weights checkpoint only (ConfigError naming spec.trainer.lora otherwise)."""
        spec_lora = self.spec.trainer.lora
        adapter = bool(meta.extra.get("adapter"))
        if spec_lora is not None and not adapter:
            raise ConfigError(lora.FIELD, f"checkpoint {path} holds full weights, not a LoRA adapter: resume it "
                                          "without spec.trainer.lora, or start the LoRA job in an empty checkpoint "
                                          "directory")
        if spec_lora is None and adapter:
            raise ConfigError(lora.FIELD, f"checkpoint {path} holds a LoRA adapter: resume it with the "
                                          "spec.trainer.lora it was trained with")
        if spec_lora is None:
            return ckpt.load_weights
        return lambda p: lora.read_adapter(p, spec_lora)

    # --- weights ---

    @property
    def sends_adapter(self) -> bool:
        """Weight updates carry the LoRA adapter only (to the native engine, which merges it into its base copy);
        an engine that takes full weights (vLLM) gets the merged weights instead (docs/design.md §5.6)."""
        return self.spec.trainer.lora is not None and self.spec.inference.engine == "native"

    def weight_update(self):
        """What one publication sends: the adapter (`sends_adapter`) or the backend's full weights."""
        return self.backend.adapter_update() if self.sends_adapter else self.backend.weights()

    def start_weights(self) -> None:
        """Announce (and transfer) the current weights once at start-up, as Fast-LLM does at run_begin."""
        if self.sharded and self.dp is not None:
            return self._publish_stream(f"weights-start/{self.version}", start=True, version=self.version)
        weights = self._published_weights(f"weights-start/{self.version}")
        if self.publisher is not None:
            self.publisher.start(weights, version=self.version, step=self.step, documents_seen=self.documents_seen)
        if self.collective:
            self._drain(weights)

    def publish_weights(self, version: int | None = None) -> None:
        """`weights_ready` for `version` (default: the current one), then the transfer."""
        version = self.version if version is None else version
        if self.sharded and self.dp is not None:
            return self._publish_stream(f"weights/{version}", start=False, version=version)
        weights = self._published_weights(f"weights/{version}")
        if self.publisher is not None:
            self.publisher.publish(weights, version=version, step=self.step, documents_seen=self.documents_seen)
        if self.collective:
            self._drain(weights)

    def _published_weights(self, tag: str):
        """The weights to publish. Tensor parallel (collective, not streamed): an iterator that first meets the
        other ranks in the alive-checked rendezvous `tag`, because rank 0's publisher reads the first weight only
        after it opened the weight-update group, which waits for the inference servers (minutes at start-up): the
        other ranks must not wait for it inside the all-gather, which fails after the collective timeout. Rank 0's
        publisher packs its snapshot from the gathered tensors (and re-sends it to a rejoining server itself)."""
        if not self.collective or self.dp is None:
            return self.weight_update()
        self._publications += 1
        tag = f"{tag}/{self._publications}"

        def gathered():
            self.dp.gather(tag)
            yield from self.backend.weights()

        return gathered()

    @staticmethod
    def _drain(weights) -> None:
        """Tensor parallel: every weight is gathered by every rank (collectives), whether or not this rank's
        publisher read them all (rank 0's announce-only publisher reads none; the other ranks have no publisher)."""
        for _ in weights:
            pass

    def _publish_stream(self, tag: str, start: bool, version: int) -> None:
        """Sharded (COLLECTIVE, every rank): the weights streamed bucket by bucket (rlkube.core.weightsync.
        StreamedWeights): rank 0's publisher sends each bucket as the ranks gather it; the other ranks (and rank 0
        when it transfers nothing) take part in the gathers. First the ranks meet in the alive-checked rendezvous:
        building the stream is a collective, and a rank may still be loading its model at start-up."""
        self._publications += 1
        tag = f"{tag}/{self._publications}"
        self.dp.gather(tag)
        transfer = self.spec.trainer.weight_transfer
        stream = self.backend.weight_stream(transfer_dtype(transfer.dtype, self.backend.device),
                                            transfer.bucket_megabytes * 2**20,
                                            rendezvous=lambda n: self.dp.gather(f"{tag}/pass-{n}"),
                                            adapter=self.sends_adapter)
        self.last_stream = stream
        publisher = self.publisher
        kwargs = {"version": version, "step": self.step, "documents_seen": self.documents_seen}
        if publisher is not None:
            (publisher.start if start else publisher.publish)(stream, **kwargs)
        if publisher is None or not getattr(publisher, "streams", False):
            stream.drain()  # another rank's publisher sends (or rank 0's announces only: no pass runs)
        if self._publications == 1:
            log.info("weights published bucket by bucket: %d tensors in %d buckets, at most %d bytes gathered and "
                     "buffered at once on this rank", len(stream.meta["tensors"]), len(stream.meta["buckets"]),
                     stream.peak_bytes)

    def close_weights(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


# --- the role -------------------------------------------------------------------------------------


class DocumentTimeout(RuntimeError):
    """No training document arrived for the configured time (RLKUBE_DOCUMENT_TIMEOUT_S)."""


TRANSFER_POLL_S = 0.2  # how often the main thread checks for SIGTERM while a weight transfer runs
TRANSFER_GRACE_S = 2.0  # after SIGTERM, how much longer a running transfer may take before it is abandoned


class TrainerRole:
    """The trainer process's loop; `stop` is set by SIGTERM (or by a test) to finish after the current step."""

    def __init__(self, ctx: RoleContext, client: redis.Redis, trainer: Trainer, stop: threading.Event | None = None,
                 document_timeout_s: float = DEFAULT_DOCUMENT_TIMEOUT_S):
        self.ctx = ctx
        self.redis = client
        self.keys = ctx.keys
        self.trainer = trainer
        self.stop = stop or threading.Event()
        self.dp = trainer.dp
        self.leader = self.dp is None or self.dp.is_leader  # publishes events, checkpoints, transfers weights
        # docs/design.md §5.4: one consumer per data-parallel trainer rank (RLKUBE_INDEX is the node rank); with tensor
        # parallelism tensor-parallel rank 0 of each replica reads for it.
        self.consumer = protocol.consumer_name(self.dp.data_rank if self.dp is not None else ctx.index)
        self.skipped = 0
        self._episodes_last: dict[str, float] = {}  # the episode counts at the previous report
        self.document_timeout_s = document_timeout_s
        self.republished = 0  # sharded: weight publications repeated for a rejoining inference server
        self.announce_again = False  # sharded, rank 0: the documents group was lost, publish the weights again
        # A weight transfer still blocked when SIGTERM came (a thread we stopped waiting for), else None.
        self.abandoned_transfer: threading.Thread | None = None

    def _transfer(self, what: str, fn) -> bool:
        """Run a weight publication (announce + transfer) on a worker thread and wait for it, but stop waiting on
        SIGTERM: a transfer blocks until every inference rank joins or gloo's timeout (300 s) passes, which is
        far beyond any teardown grace period. True when it finished; False when it was abandoned."""
        done = threading.Event()
        error: list[BaseException] = []

        def target() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread (or logged if abandoned)
                error.append(exc)
                if self.abandoned_transfer is not None:
                    log.warning("abandoned weight transfer (%s) ended with: %s", what, exc)
            finally:
                done.set()

        thread = threading.Thread(target=target, name=f"weights-{what}", daemon=True)
        thread.start()
        while not done.wait(TRANSFER_POLL_S):
            # A transfer that is merely slow may finish within a short grace; one waiting for a peer will not.
            if self._stopping() and not done.wait(TRANSFER_GRACE_S):
                log.warning("stop requested: abandoning the weight transfer (%s), which is still blocked", what)
                self.abandoned_transfer = thread
                return False
        if error:
            raise error[0]
        return True

    def share(self, samples_per_step: int) -> int:
        """This rank's documents per step: samplesPerStep split as evenly as possible (the lower ranks take the
        remainder). Uneven shares are exact too: every rank normalises by the step's global loss-token count."""
        if self.dp is None:
            return samples_per_step
        base, extra = divmod(samples_per_step, self.dp.data_size)
        return base + (1 if self.dp.data_rank < extra else 0)

    def _stopping(self) -> bool:
        """SIGTERM here, or (data-parallel) on another rank: stop after the current step."""
        if self.stop.is_set():
            if self.dp is not None:
                self.dp.announce_stop()
            return True
        return self.dp is not None and self.dp.stop_announced()

    def _event(self, type_: str, **fields: Any) -> None:
        if not self.leader:
            return
        self.redis.xadd(self.keys.events, protocol.encode_event(type_, **fields))

    def read_documents(self, want: int) -> list[protocol.Document]:
        """Up to `want` documents (blocks up to READ_BLOCK_MS); malformed entries are logged and skipped."""
        try:
            got = self.redis.xreadgroup(
                protocol.DOCUMENTS_GROUP, self.consumer, {self.keys.documents: ">"}, count=want,
                block=READ_BLOCK_MS, noack=True,
            )
        except redis.ResponseError as exc:
            if not protocol.group_lost(exc):
                raise
            # A managed Redis restarted empty: the documents in it are lost either way; recreating the group lets
            # training go on from the preprocessor's next documents. The events went too, so announce the current
            # weights again: an actor that restarted meanwhile waits for a weights_ready before it samples.
            log.warning("the documents group is gone (%s): creating it again and re-announcing version %d",
                        exc, self.trainer.version)
            streams.ensure_group(self.redis, self.keys.documents, protocol.DOCUMENTS_GROUP)
            if self.trainer.collective and self.dp is not None:
                # A collective of every rank, which the other ranks may not be ready for now: rank 0 asks for it
                # through the same agreement as a rejoining inference server (_republish_due).
                self.announce_again = self.announce_again or self.leader
            else:
                self._transfer(f"version {self.trainer.version} again", self.trainer.publish_weights)
            return []
        docs = []
        for _, entries in got or []:
            for sid, fields in entries:
                sid = sid.decode() if isinstance(sid, bytes) else sid
                try:
                    doc = protocol.decode_document(fields)
                    self._check_length(doc)
                except ValueError as exc:
                    self.skipped += 1
                    log.warning("skipping malformed document %s: %s", sid, exc)
                    continue
                docs.append(doc)
        return docs

    def _check_length(self, doc: protocol.Document) -> None:
        n, limit = len(doc.tokens), self.trainer.backend.max_sequence_length
        if n < 2:
            raise ValueError(f"{n} tokens: a document needs at least 2")
        if n > limit:
            raise ValueError(f"{n} tokens exceed the model's maxSequenceLength {limit}")

    def _collect_step(self, want: int, docs: list[protocol.Document] | None = None
                      ) -> list[protocol.Document] | None:
        """Exactly `want` documents (added to `docs`), or None when asked to stop before they arrived. Sharded or
        tensor parallel: returns `docs` short when the weights must be sent again first (`_republish_due`). A
        tensor-parallel peer that does not read returns at once (it gets its reader's documents in `run`)."""
        docs = [] if docs is None else docs
        if self.dp is not None and not self.dp.reads_documents:
            return None if self._stopping() else docs
        # Like Fast-LLM: the timeout counts time spent WAITING without a document (not training or transfers).
        last_document = time.monotonic()
        while len(docs) < want:
            if self._stopping():
                if docs:
                    log.info("stopping: dropping a partial step of %d/%d documents", len(docs), want)
                return None
            if self._republish_due():
                return docs
            if self.dp is not None:
                self.dp.check_peers()  # a dead peer must not go unnoticed while no documents come
            got = self.read_documents(want - len(docs))
            now = time.monotonic()
            if got:
                last_document = now
            elif now - last_document > self.document_timeout_s:
                raise DocumentTimeout(
                    f"no training document for {self.document_timeout_s:g}s ({ENV_DOCUMENT_TIMEOUT}); "
                    f"{len(docs)}/{want} documents of step {self.trainer.step + 1} received"
                )
            docs.extend(got)
        return docs

    def run(self) -> int:
        spec, t = self.ctx.spec, self.trainer
        algo = spec.algorithm
        interval = spec.trainer.checkpoint.interval_steps
        per_rank = self.share(algo.samples_per_step)
        streams.ensure_group(self.redis, self.keys.documents, protocol.DOCUMENTS_GROUP)
        if t.step >= algo.max_steps:
            code = self._finish_again() if self.leader else 0
            if self.dp is not None:
                self.dp.finish()
            return code
        published = self._transfer("initial weights", t.start_weights)
        log.info("training from step %d to %d, %d documents per step (%d per rank)", t.step, algo.max_steps,
                 algo.samples_per_step, per_rank)
        try:
            while t.step < algo.max_steps:
                t0 = time.monotonic()
                docs: list[protocol.Document] | None = []
                while True:
                    if not published or self._stopping():
                        docs = None
                    else:
                        docs = self._collect_step(per_rank, docs)
                    if self.dp is None:
                        break
                    # Meet outside any collective (a peer may still wait for documents or a weight transfer), then
                    # agree: one rank stopping stops all of them after the same step.
                    self.dp.gather(f"step/{t.step + 1}/{self.republished}", while_waiting=self._republish_due)
                    if self.dp.any(docs is None):
                        if docs is not None:
                            log.info("stopping with the other ranks: dropping this rank's %d documents of step %d",
                                     len(docs), t.step + 1)
                        docs = None
                        break
                    if not (t.collective and self.dp.any(self._republish_due())):
                        break
                    published = self._republish()  # then go on collecting this step's documents
                if docs is not None and self.dp is not None:
                    docs = self.dp.share_with_tensor_peers(docs)  # tensor parallel: the reader's documents
                if docs is None:
                    break
                t1 = time.monotonic()
                version_before = t.version
                step_metrics = t.train_step(docs)
                doc_stats = self._document_stats(docs, version_before)  # of every rank's documents (a collective)
                t2 = time.monotonic()
                if self.leader or t.collective:  # sharded or tensor parallel: every rank gathers, rank 0 sends
                    published = self._transfer(f"version {t.version}", lambda: t.publish_weights(t.version))
                t3 = time.monotonic()
                self._event(protocol.METRICS, **self._metrics(doc_stats, step_metrics, t1 - t0, t2 - t1, t3 - t2))
                if (self.leader or t.collective) and t.step % interval == 0:
                    self._checkpoint()
        except (DocumentTimeout, PeerLost, torch.distributed.DistError):
            # Documents stopped coming, or another trainer rank died: keep what was trained (the consumed documents
            # are gone from the group; a step's weights change only after its collectives succeeded, so they are
            # consistent), but publish no training_finished: this is a failure, and the operator must not read it
            # as completion.
            # (Sharded: saving is a collective with a peer that may be gone; the last interval's checkpoint stays.)
            if (self.leader and not t.collective and t.step
                    and (t.last_checkpoint is None or t.last_checkpoint[0] != t.step)):
                self._checkpoint()
            raise
        if self.leader:
            self._finish(interrupted=t.step < algo.max_steps)
        elif t.collective and (t.last_checkpoint is None or t.last_checkpoint[0] != t.step):
            t.save_checkpoint()  # its part of rank 0's final checkpoint (a collective)
        if self.dp is not None:
            self.dp.finish()  # the other ranks exit only after rank 0's final checkpoint and training_finished
        return 0

    def _republish_due(self) -> bool:
        """Sharded (or tensor parallel, collective weights): an inference server restarted and asked to rejoin, and
        rank 0 has no snapshot to send it from its watchdog (the weights are streamed from the shards), or Redis
        lost the events (read_documents): all ranks must gather the weights again. Rank 0 raises the flag in the trainer's store; every rank sees it
        while waiting for documents or for its peers, and all agree (`run`) before the collective transfer.
        Without it a server that restarts while the trainer waits for documents (which only come once the server
        serves again) would keep it waiting until the document timeout."""
        if not self.trainer.collective or self.dp is None:
            return False
        key = f"republish/{self.republished}"
        if self.leader and (self.announce_again or getattr(self.trainer.publisher, "rejoin_pending", False)):
            self.dp.store.set(key, "1")
            return True
        return self.dp.store.check([key])

    def _republish(self) -> bool:
        log.warning("sending version %d again (every rank gathers): an inference server asked to rejoin, or the "
                    "events were lost", self.trainer.version)
        self.republished += 1
        self.announce_again = False
        return self._transfer(f"version {self.trainer.version} again", self.trainer.publish_weights)

    def _finish(self, interrupted: bool) -> None:
        t = self.trainer
        if t.last_checkpoint is None or t.last_checkpoint[0] != t.step:
            self._checkpoint()
        if self.abandoned_transfer is None:
            # close() first waits for a transfer still running (WeightPublisher(overlap=True)): interruptible too
            self._transfer("close", t.close_weights)
        if self.abandoned_transfer is not None:
            # close() would wait for the blocked transfer; the inference servers leave the group on
            # training_finished, and the process exits without joining the transfer thread (see main()).
            log.warning("not closing the weight-update group: a transfer is still blocked in it")
        self._report_finished(interrupted)

    def _report_finished(self, interrupted: bool) -> None:
        step, path = self.trainer.last_checkpoint
        self._event(protocol.TRAINING_FINISHED, step=step, checkpoint=str(path), interrupted=interrupted,
                    documents_seen=self.trainer.documents_seen)
        log.info("training finished at step %d (interrupted=%s), checkpoint %s", step, interrupted, path)

    def _finish_again(self) -> int:
        """A restarted trainer whose checkpoint already holds every step (killed after the final checkpoint, before
        or after training_finished): report the finish again and exit 0. It must not open the weight-update group:
        the inference servers left it on the first training_finished, so the start-up transfer would wait for
        ranks that never join (gloo's 300 s) and the job would hang with its work done."""
        step, path = self.trainer.last_checkpoint  # set by resume(): only a resumed trainer starts at maxSteps
        log.info("checkpoint %s already holds all %d steps: nothing to train, reporting training_finished again",
                 path, step)
        self._report_finished(interrupted=False)
        return 0

    def _checkpoint(self) -> None:
        path = self.trainer.save_checkpoint()
        if self.leader:
            self._event(protocol.CHECKPOINT_SAVED, step=self.trainer.step, path=str(path))

    def _document_stats(self, docs: Sequence[protocol.Document], version: int) -> dict[str, float]:
        """The step's document statistics; with data parallelism, over every rank's share (two tiny collectives,
        on every rank: the metrics rank 0 publishes describe the whole step)."""
        versions = [int(d.model_version[d.loss_mask()].min()) for d in docs
                    if d.model_version is not None and d.loss_mask().any()]
        lags = [version - v for v in versions]
        sums = [sum(d.reward for d in docs), len(docs), sum(len(d.tokens) for d in docs),
                sum(1 for lag in lags if lag > self.ctx.spec.algorithm.max_lag), sum(d.reward_error for d in docs)]
        lag_max = max(lags) if lags else 0
        if self.dp is not None:
            sums = self.dp.sum(sums)
            lag_max = self.dp.max(lag_max)
        reward_sum, n, tokens, stale, reward_errors = sums
        return {"reward_mean": reward_sum / max(n, 1), "lag_max": int(lag_max), "stale_documents": int(stale),
                "tokens": int(tokens), "reward_errors": int(reward_errors)}

    def _metrics(self, d: dict[str, float], m: dict[str, float], wait_s: float, busy_s: float,
                 publish_s: float) -> dict[str, Any]:
        tokens = d["tokens"]
        wall = max(wait_s + busy_s + publish_s, 1e-9)
        return {
            "step": self.trainer.step,
            "version": self.trainer.version,
            "loss": m["loss"],
            "reward_mean": d["reward_mean"],
            "reward_errors": d["reward_errors"],  # samples whose reward function failed (scored 0)
            "lag_max": d["lag_max"],
            "stale_documents": d["stale_documents"],
            "tokens": tokens,
            "loss_tokens": int(m["loss_tokens"]),
            "tokens_per_s": tokens / wall,
            "busy_s": busy_s,
            "wait_s": wait_s,
            "publish_s": publish_s,
            "ratio_mean": m["ratio_mean"],
            "clipped_fraction": m["clipped_fraction"],
            "kl": m["kl"],
            "entropy": m.get("entropy"),
            # trainer vs sampler and the reference KL (rlkube.core.losses); absent when nothing measured them
            **{k: m[k] for k in ("logprob_diff_abs", "is_ratio_mean", "is_ratio_min", "is_ratio_max",
                                 "is_truncated_fraction", "is_masked_fraction", "ref_kl") if k in m},
            "grad_norm": m["grad_norm"],
            "learning_rate": m["lr"],
            "documents_seen": self.trainer.documents_seen,
            "documents_skipped": self.skipped,
            **self._filtered(),
            **self._episodes(),
        }

    def _filtered(self) -> dict[str, int]:
        """Zero-advantage groups (and their samples) the preprocessors dropped so far, whole job (rank 0 only:
        it alone publishes the metrics)."""
        if not self.leader:
            return {}
        groups, samples = self.redis.mget(self.keys.filtered_groups, self.keys.filtered_samples)
        return {"filtered_groups": int(groups or 0), "filtered_samples": int(samples or 0)}


    def _episodes(self) -> dict[str, float]:
        """The actors' multi-turn episode counts (rlkube.core.episodes), whole job so far, and per episode since
        the previous step's report (rank 0 only); nothing for single-turn jobs."""
        if not self.leader or self.ctx.spec.task.environment is None:
            return {}
        raw = self.redis.hgetall(self.keys.episodes)
        totals = {protocol.text(k): float(v) for k, v in raw.items()}
        last = self._episodes_last
        self._episodes_last = totals
        out: dict[str, float] = {f"episode_{k}": int(totals.get(k, 0)) for k in EPISODE_COUNTS}
        new = totals.get("episodes", 0) - last.get("episodes", 0)
        if new > 0:
            for key in ("turns", "tool_calls"):
                out[f"{key}_per_episode"] = (totals.get(key, 0) - last.get(key, 0)) / new
        rewarded = totals.get("turn_rewards", 0) - last.get("turn_rewards", 0)
        if rewarded > 0:  # the mean reward per rewarded turn since the previous report
            out["turn_reward_mean"] = (totals.get("turn_reward_sum", 0) - last.get("turn_reward_sum", 0)) / rewarded
        return out


EPISODE_COUNTS = ("episodes", "turns", "tool_calls", "tool_errors", "tool_timeouts", "sandbox_refusals",
                  "truncated", "timed_out", "drifted", "turn_rewards")


def _make_publisher(ctx: RoleContext, client: redis.Redis, device: str) -> Publisher:
    if not ctx.weight_sync_addr:
        log.info("%s unset: announcing weights without transferring them", "RLKUBE_WEIGHT_SYNC_ADDR")
        return AnnounceOnly(client, ctx.keys)
    transfer = ctx.spec.trainer.weight_transfer
    return WeightPublisher(client, ctx.keys, ctx.weight_sync_addr, ctx.weight_sync_world_size,
                           backend="nccl" if device.startswith("cuda") else "gloo", device=device,
                           transfer_dtype=transfer_dtype(transfer.dtype, device),
                           bucket_bytes=transfer.bucket_megabytes * 2**20)


def require_expected_checkpoint(trainer: Trainer, env) -> None:
    """After resume(): a trainer whose launcher saw checkpoint N saved (runtime.ENV_RESUME_CHECKPOINT) and that
    resumed from none, or from an older one, raises ConfigError (exit runtime.EXIT_CONFIG) instead of training on
    from there: the job would lose its progress silently (rlkube.contract.checkpoint_loss)."""
    resumed = trainer.last_checkpoint[0] if trainer.last_checkpoint is not None else None
    message = checkpoint_loss.loss(env.get(runtime.ENV_RESUME_CHECKPOINT), resumed, str(trainer.checkpoint_dir))
    if message is not None:
        raise ConfigError(checkpoint_loss.FIELD, message)


def build_role(ctx: RoleContext, client: redis.Redis, stop: threading.Event | None = None,
               document_timeout_s: float = DEFAULT_DOCUMENT_TIMEOUT_S, env=None) -> TrainerRole:
    spec = ctx.spec
    env = os.environ if env is None else env
    world = trainer_world_size(spec)
    if world > 1 and spec.trainer.backend not in ("torch", "megatron"):
        raise ValueError(f"spec.trainer.backend={spec.trainer.backend}: `python -m rlkube.core.trainer` trains it "
                         f"in one process, not {world} ranks (data parallelism: backends torch and megatron)")
    sharded = spec.trainer.sharding == "fsdp"  # over world > 1 ranks (rlkube.lifecycle.validation)
    cfg = DistConfig.from_env(env) if world > 1 else None
    if cfg is not None and cfg.world_size != world:
        raise ValueError(f"WORLD_SIZE={cfg.world_size} but the spec has {world} trainer ranks (spec.trainer.nodes "
                         f"{spec.trainer.nodes} x {processes_per_node(spec)} processes per node)")
    device = "cuda" if spec.trainer.gpus_per_node > 0 and torch.cuda.is_available() else "cpu"
    if device == "cuda" and cfg is not None:
        device = f"cuda:{cfg.local_rank}"
        torch.cuda.set_device(device)
    # The group first: a rank restarted alone must fail at once (DataParallel), not after loading the model.
    dp = DataParallel(cfg, device=device) if cfg is not None else None
    leader = dp is None or dp.is_leader
    # Only rank 0 joins the weight-update group with the inference servers.
    publisher = _make_publisher(ctx, client, device) if leader else None
    model_dir = materialize_model(spec.model, ctx.model_cache_dir)
    trainer = Trainer(spec, checkpoint_dir=ctx.checkpoint_dir, publisher=publisher, device=device, dp=dp,
                      model_dir=model_dir)
    if ctx.checkpoint_dir is None:
        log.warning("RLKUBE_CHECKPOINT_DIR unset: using ./checkpoints")
        trainer.checkpoint_dir = Path("checkpoints")
    if sharded:
        # Every rank writes and reads its own shards: the checkpoint directory must be one volume all ranks see
        # (an RWX claim, or one machine). Ranks that disagree on where to resume fail here, not in a collective.
        trainer.resume()
        require_expected_checkpoint(trainer, env)
        steps = dp.sum([trainer.step, 1])
        if steps[0] != trainer.step * steps[1]:
            raise RuntimeError(f"trainer rank {dp.rank} resumes at step {trainer.step}, not every rank does: "
                               "spec.trainer.sharding 'fsdp' needs a checkpoint volume shared by all trainer ranks")
    elif leader:
        # Rank 0 alone resumes: in a cluster each trainer pod has its own checkpoint volume (unless an RWX claim
        # is shared), and only rank 0 writes checkpoints; the others get the state by broadcast.
        trainer.resume()
        require_expected_checkpoint(trainer, env)
    else:
        trainer.checkpoint_dir = None
    trainer.sync_from_leader()
    return TrainerRole(ctx, client, trainer, stop, document_timeout_s=document_timeout_s)


def main() -> int:
    stop = stop_on_signals("trainer", log, "finishing the current step, then checkpoint and training_finished")
    try:
        ctx = RoleContext.from_env()
        timeout_s = document_timeout_from_env(os.environ)
        client = redis.Redis.from_url(ctx.redis_url)
        code = build_role(ctx, client, stop, document_timeout_s=timeout_s).run()
    except DocumentTimeout as exc:
        log.error("giving up: %s (no training_finished published)", exc)
        write_termination_message(str(exc))
        code = 1
    except ConfigError:
        raise  # bad input (e.g. the model directory): run_role writes the termination message, EXIT_CONFIG
    except Exception as exc:
        log.exception("trainer failed (no training_finished published)")
        write_termination_message(f"{type(exc).__name__}: {exc}")
        code = 1
    # Leave without the interpreter's teardown, always: an abandoned transfer thread is blocked inside gloo and
    # process-group destructors could wait on it; a data-parallel rank that failed may have left its group
    # mid-collective; and with torch.distributed and transformers loaded, the C++ teardown alone took 2-10 s on a
    # busy 2-core machine, time the teardown grace period does not have. Everything that matters (checkpoint,
    # events) is durable by now; only the logs need flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    from rlkube.core.errors import run_role

    sys.exit(run_role(main))
