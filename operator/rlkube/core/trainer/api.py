"""The trainer API (docs/design.md §6): `Trainer` with forward_backward / optim_step / save_checkpoint /
publish_weights, apart from the role loop that drives it (rlkube.core.trainer.role).

`Trainer` is backend-independent: it loads the job's Hugging Face model directory (materialized from
`spec.model.path`) into the backend, turns documents into micro-batches by a token budget
(`spec.trainer.microBatchTokens`), accumulates their gradients normalised by the step's loss-token count, steps the
optimizer, writes checkpoints that are HF directories, and hands the weights (HF names) to a publisher.

The parallel mode is chosen once, at construction (rlkube.core.trainer.parallel: one process, or a rank of a
data-parallel group); what a backend does differently is its declared capabilities (`sharded`: FSDP shards the
model, `collective`: weights and state are collectives of every rank, as with megatron's tensor parallelism).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.contract import protocol
from rlkube.core.training import checkpoint as ckpt
from rlkube.core.training import lora
from rlkube.core.backends import TrainerBackend, build_backend
from rlkube.core.backends.torch_distributed import DataParallel
from rlkube.core.training.batch import Batch, collate, plan_micro_batches
from rlkube.core.errors import ConfigError
from rlkube.core.hf.source import materialize_model
from rlkube.core.training.losses import LossStats
from rlkube.core.trainer.parallel import Parallel, choose
from rlkube.core.trainer.publishers import Publisher
from rlkube.core.weights.wire import transfer_dtype

log = logging.getLogger("rlkube.trainer")


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
        # dp None: one process; else gradients and counts are summed over the data-parallel ranks (with model
        # parallelism over the data-parallel replicas only)
        self.parallel: Parallel = choose(dp, self.backend.parallel_layout)
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
        if self.sharded:
            # FSDP's gathers and reduce-scatters are collectives: every rank runs as many passes as the busiest.
            for _ in range(int(self.parallel.max(len(micro))) - len(micro)):
                self.backend.forward_backward_nothing()
        self._pending = self._pending.merge(stats)
        self._pending_normalizer = norm
        return stats.metrics(norm)

    def optim_step(self) -> dict[str, float]:
        """Clip, step, zero the gradients (after the step). Returns grad_norm, policy_version and the loss
        statistics of everything accumulated since the previous step (summed over the data-parallel ranks)."""
        # A sharded backend reduce-scattered its gradients already (summed, torch_fsdp): only the statistics.
        self._pending = self.parallel.reduce_stats(
            self._pending, None if self.sharded else self.backend.gradient_parameters())
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
        loss_tokens, n_docs = self.parallel.sum([loss_tokens, n_docs])
        self._accumulate(micro, normalizer=max(loss_tokens, 1))
        self.documents_seen += int(n_docs)
        return self.optim_step()

    def sync_from_leader(self) -> None:
        """Data parallelism: every rank takes rank 0's weights, optimizer state and counters (after rank 0 resumed
        from its checkpoint, or fresh), so all ranks start identical however they were initialised."""
        if self.sharded:
            # Every rank loaded the same initial weights and resumes from the distributed checkpoint.
            return
        self.step, self.documents_seen = self.parallel.sync_from_leader(
            self.backend, (self.step, self.documents_seen), self._resumed_state, tensor_parallel=self.collective)
        self._resumed_state = None

    # --- checkpoints ---

    def save_checkpoint(self, step: int | None = None) -> Path | None:
        """Rank 0 writes the checkpoint (returns its path); with a collective backend every rank must call this,
        and the others return None."""
        step = self.step if step is None else step
        tensor_parallel_peer = self.collective and not self.sharded and not self.parallel.leader
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
        # PEFT's adapter directory instead of the weights (core/training/checkpoint.py)
        if self.spec.trainer.lora is not None:
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
        if self.parallel.leader:
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
        if self.collective and self.parallel.has_peers:
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
        if self.sharded and self.parallel.has_peers:
            return self._publish_stream(f"weights-start/{self.version}", start=True, version=self.version)
        weights = self._published_weights(f"weights-start/{self.version}")
        if self.publisher is not None:
            self.publisher.start(weights, version=self.version, step=self.step, documents_seen=self.documents_seen)
        if self.collective:
            self._drain(weights)

    def publish_weights(self, version: int | None = None) -> None:
        """`weights_ready` for `version` (default: the current one), then the transfer."""
        version = self.version if version is None else version
        if self.sharded and self.parallel.has_peers:
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
        if not (self.collective and self.parallel.has_peers):
            return self.weight_update()
        self._publications += 1
        tag = f"{tag}/{self._publications}"

        def gathered():
            self.parallel.meet(tag)
            yield from self.backend.weights()

        return gathered()

    @staticmethod
    def _drain(weights) -> None:
        """Tensor parallel: every weight is gathered by every rank (collectives), whether or not this rank's
        publisher read them all (rank 0's announce-only publisher reads none; the other ranks have no publisher)."""
        for _ in weights:
            pass

    def _publish_stream(self, tag: str, start: bool, version: int) -> None:
        """Sharded (COLLECTIVE, every rank): the weights streamed bucket by bucket (rlkube.core.weights.wire.
        StreamedWeights): rank 0's publisher sends each bucket as the ranks gather it; the other ranks (and rank 0
        when it transfers nothing) take part in the gathers. First the ranks meet in the alive-checked rendezvous:
        building the stream is a collective, and a rank may still be loading its model at start-up."""
        self._publications += 1
        tag = f"{tag}/{self._publications}"
        self.parallel.meet(tag)
        transfer = self.spec.trainer.weight_transfer
        stream = self.backend.weight_stream(transfer_dtype(transfer.dtype, self.spec.model.dtype),
                                            transfer.bucket_megabytes * 2**20,
                                            rendezvous=lambda n: self.parallel.meet(f"{tag}/pass-{n}"),
                                            adapter=self.sends_adapter)
        self.last_stream = stream
        publisher = self.publisher
        kwargs = {"version": version, "step": self.step, "documents_seen": self.documents_seen}
        if publisher is not None:
            (publisher.start if start else publisher.publish)(stream, **kwargs)
        if publisher is None or not publisher.streams:
            stream.drain()  # another rank's publisher sends (or rank 0's announces only: no pass runs)
        if self._publications == 1:
            log.info("weights published bucket by bucket: %d tensors in %d buckets, at most %d bytes gathered and "
                     "buffered at once on this rank", len(stream.meta["tensors"]), len(stream.meta["buckets"]),
                     stream.peak_bytes)

    def close_weights(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

