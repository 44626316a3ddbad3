"""The trainer ROLE (`python -m rlkube.core.trainer`): the loop around the Trainer API (rlkube.core.trainer.api).

Why a loop apart from the API: the API trains; this loop keeps what the other roles and the operator rely on: the
documents it reads (docs/design.md §5.4), the events it publishes and their order (§5.2), `training_finished` only
after the final checkpoint is durable (§4.6; never on a crash, docs/references.md §6.3), a lost checkpoint volume
refused (exit 78, reason CheckpointLost: rlkube.contract.checkpoint_loss) and the ranks (docs/design.md §6: rank 0
alone loads and writes checkpoints, transfers weights and publishes). Each step of `TrainerRole.run` is named:
collect, train, publish, checkpoint. Weight transfers run on a worker thread that SIGTERM stops waiting for (a
transfer waits for every inference rank, up to gloo's 300 s). With megatron's tensor parallelism, tensor-parallel
rank 0 of replica r reads as `fast_llm_consumer_{r}` and hands the documents to its peers (`DataParallel.use_layout`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
import torch

from rlkube.contract import checkpoint_loss, protocol, runtime, streams
from rlkube.contract.context import RoleContext
from rlkube.contract.parallel import processes_per_node, trainer_world_size
from rlkube.core.backends.torch_distributed import DataParallel, DistConfig, PeerLost
from rlkube.core.errors import ConfigError, write_termination_message
from rlkube.core.hf.source import materialize_model
from rlkube.core.startup import stop_on_signals
from rlkube.core.trainer.api import Trainer
from rlkube.core.trainer.publishers import _make_publisher
from rlkube.core.trainer.reporting import StepReports
from rlkube.core.tracking import Trackers, build_trackers
from rlkube.core.tracking.fanout import TRACKING_DIR, job_params
from rlkube.core.trainer.samples import SampleKeeper, output_dir

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


class DocumentTimeout(RuntimeError):
    """No training document arrived for the configured time (RLKUBE_DOCUMENT_TIMEOUT_S)."""


TRANSFER_POLL_S = 0.2  # how often the main thread checks for SIGTERM while a weight transfer runs
TRANSFER_GRACE_S = 2.0  # after SIGTERM, how much longer a running transfer may take before it is abandoned


class TrainerRole(StepReports):
    """The trainer process's loop; `stop` is set by SIGTERM (or by a test) to finish after the current step."""

    def __init__(self, ctx: RoleContext, client: redis.Redis, trainer: Trainer, stop: threading.Event | None = None,
                 document_timeout_s: float = DEFAULT_DOCUMENT_TIMEOUT_S, samples: SampleKeeper | None = None,
                 trackers: Trackers | None = None):
        self.ctx = ctx
        self.redis = client
        self.keys = ctx.keys
        self.trainer = trainer
        self.stop = stop or threading.Event()
        self.parallel = trainer.parallel
        self.leader = self.parallel.leader  # publishes events, checkpoints, transfers weights
        # docs/design.md §5.4: one consumer per data-parallel trainer rank (RLKUBE_INDEX is the node rank); with tensor
        # parallelism tensor-parallel rank 0 of each replica reads for it.
        self.consumer = protocol.consumer_name(self.parallel.consumer_index(ctx.index))
        self.skipped = 0
        self._episodes_last: dict[str, float] = {}  # the episode counts at the previous report
        self.document_timeout_s = document_timeout_s
        self.republished = 0  # sharded: weight publications repeated for a rejoining inference server
        self.announce_again = False  # with peers: this rank saw the documents group lost, publish the weights again
        self.published = True  # the last weight transfer finished (False: abandoned on SIGTERM)
        # A weight transfer still blocked when SIGTERM came (a thread we stopped waiting for), else None.
        self.abandoned_transfer: threading.Thread | None = None
        # spec.tracking (rank 0; does nothing when none is configured): metrics, evaluation results, sample tables.
        self.trackers = trackers if trackers is not None else Trackers.none()
        self._tracked_events = "0-0"  # how far the events stream was read for evaluation results
        self._eval_versions: set[int] = set()
        # spec.samples: the step's sample tables and the evaluation's (rlkube.core.trainer.samples); None: none kept
        self.samples = samples
        if samples is not None and samples.trackers is None:
            samples.trackers = self.trackers  # each table also goes to the trackers that keep tables

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
        """This rank's documents per step (rlkube.core.trainer.parallel)."""
        return self.parallel.share(samples_per_step)

    def _stopping(self) -> bool:
        """SIGTERM here, or (data-parallel) on another rank: stop after the current step."""
        return self.parallel.stopping(self.stop)

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
            if self.parallel.has_peers:
                # The rank that sees the loss first recreates the group, so the others may never see it (rank 0
                # included, which alone announces): whichever rank saw it raises the flag every rank waits on, and
                # the ranks publish again together (_republish_due; sharded, a collective).
                self.announce_again = True
            else:
                self._transfer(f"version {self.trainer.version} again", self.trainer.publish_weights)
            return []
        docs = []
        for _, entries in got or []:
            for sid, fields in entries:
                sid = sid.decode() if isinstance(sid, bytes) else sid
                try:
                    doc = protocol.decode_document(fields)
                    doc.stream_id = sid
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
        tensor-parallel peer that does not read returns at once (it gets its reader's documents in `_collect`)."""
        docs = [] if docs is None else docs
        if not self.parallel.reads_documents:
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
            self.parallel.check_peers()
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
        """Step after step: collect -> train -> publish -> checkpoint, until maxSteps or a stop; then finish."""
        t, algo = self.trainer, self.ctx.spec.algorithm
        per_rank = self.share(algo.samples_per_step)
        streams.ensure_group(self.redis, self.keys.documents, protocol.DOCUMENTS_GROUP)
        if t.step >= algo.max_steps:
            code = self._finish_again() if self.leader else 0
            self.parallel.finish()
            return code
        self.published = self._transfer("initial weights", t.start_weights)
        log.info("training from step %d to %d, %d documents per step (%d per rank)", t.step, algo.max_steps,
                 algo.samples_per_step, per_rank)
        try:
            while t.step < algo.max_steps:
                t0 = time.monotonic()
                docs = self._collect(per_rank)
                if docs is None:
                    break
                t1 = time.monotonic()
                version_before = t.version
                step_metrics, doc_stats = self._train(docs)
                self._keep_samples(version_before, docs)
                t2 = time.monotonic()
                self._publish()
                t3 = time.monotonic()
                metrics = self._metrics(doc_stats, step_metrics, t1 - t0, t2 - t1, t3 - t2)
                self._event(protocol.METRICS, **metrics.payload())
                self._track_step(metrics)
                self._checkpoint_if_due()
        except (DocumentTimeout, PeerLost, torch.distributed.DistError):
            # Documents stopped coming, or another trainer rank died: keep what was trained (the consumed documents
            # are gone from the group; a step's weights change only after its collectives succeeded, so they are
            # consistent), but publish no training_finished: this is a failure, and the operator must not read it
            # as completion.
            # (Sharded: saving is a collective with a peer that may be gone; the last interval's checkpoint stays.)
            if (self.leader and not t.collective and t.step
                    and (t.last_checkpoint is None or t.last_checkpoint[0] != t.step)):
                self._checkpoint()
            self._close_trackers(finished=False)
            raise
        if self.leader:
            self._finish(interrupted=t.step < algo.max_steps)
        elif t.collective and (t.last_checkpoint is None or t.last_checkpoint[0] != t.step):
            t.save_checkpoint()  # its part of rank 0's final checkpoint (a collective)
        self.parallel.finish()  # the other ranks exit only after rank 0's final checkpoint and training_finished
        return 0

    def _collect(self, want: int) -> list[protocol.Document] | None:
        """collect: this rank's `want` documents of the next step, or None to stop. The ranks meet and agree:
        one rank stopping stops all of them after the same step, and weights some rank must send again
        (`_republish_due`) are sent before the step's documents are collected on."""
        t = self.trainer
        docs: list[protocol.Document] | None = []
        while True:
            docs = None if not self.published or self._stopping() else self._collect_step(want, docs)
            # Meet outside any collective (a peer may still wait for documents or a weight transfer).
            self.parallel.meet(f"step/{t.step + 1}/{self.republished}", while_waiting=self._republish_due)
            if self.parallel.any(docs is None):
                if docs is not None:
                    log.info("stopping with the other ranks: dropping this rank's %d documents of step %d",
                             len(docs), t.step + 1)
                return None
            if not self.parallel.any(self._republish_due()):
                return self.parallel.share_with_tensor_peers(docs)  # tensor parallel: the reader's documents
            self.published = self._republish()  # then go on collecting this step's documents

    def _train(self, docs: Sequence[protocol.Document]) -> tuple[dict[str, float], dict[str, float]]:
        """train: one optimizer step on the step's documents; its metrics, and the statistics of every rank's
        documents (a collective)."""
        version_before = self.trainer.version
        step_metrics = self.trainer.train_step(docs)
        return step_metrics, self._document_stats(docs, version_before)

    def _keep_samples(self, version: int, docs: Sequence[protocol.Document]) -> None:
        """spec.samples: the step's documents' records are dropped, a due step's table and any new evaluation
        rows appended to samples.jsonl (rank 0). Never fails the step: a sample is for people, not training."""
        if self.samples is None:
            return
        try:
            self.samples.keep_step(self.trainer.step, version, docs)
            self.samples.forget(docs)
            self.samples.drain_evaluations(self.trainer.step)
        except Exception as exc:  # noqa: BLE001 - a full disk, a tokenizer that will not load: never the step
            log.warning("step %d: keeping its samples failed: %s: %s", self.trainer.step, type(exc).__name__, exc)

    def _publish(self) -> None:
        """publish: the new version's weights (sharded or tensor parallel: every rank gathers, rank 0 sends)."""
        t = self.trainer
        if self.leader or t.collective:
            self.published = self._transfer(f"version {t.version}", lambda: t.publish_weights(t.version))

    def _checkpoint_if_due(self) -> None:
        """checkpoint: every spec.trainer.checkpoint.intervalSteps (a collective of every rank when sharded)."""
        t = self.trainer
        if (self.leader or t.collective) and t.step % self.ctx.spec.trainer.checkpoint.interval_steps == 0:
            self._checkpoint()

    def _republish_due(self) -> bool:
        """The ranks must publish the weights again: Redis lost the events (read_documents; any rank may be the one
        that saw it), or, sharded or tensor parallel (collective weights), an inference server restarted and asked
        to rejoin and rank 0 has no snapshot to send it from its watchdog (the weights are streamed from the
        shards). The flag is raised in the trainer's store; every rank sees it while waiting for documents or for
        its peers, and all agree (`_collect`) before the transfer (a collective when sharded).
        Without it a server that restarts while the trainer waits for documents (which only come once the server
        serves again) would keep it waiting until the document timeout."""
        publisher = self.trainer.publisher
        rejoin = (self.trainer.collective and self.leader and publisher is not None and publisher.rejoin_pending)
        return self.parallel.signal(f"republish/{self.republished}", raised=self.announce_again or rejoin)

    def _republish(self) -> bool:
        t = self.trainer
        log.warning("sending version %d again (%s): an inference server asked to rejoin, or the events were lost",
                    t.version, "every rank gathers" if t.collective else "rank 0 sends")
        self.republished += 1
        self.announce_again = False
        if not (self.leader or t.collective):
            return True
        return self._transfer(f"version {t.version} again", t.publish_weights)

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
        self._close_trackers(finished=not interrupted)
        self._report_finished(interrupted)

    def _drain_evaluation_samples(self) -> None:
        """spec.samples: the evaluation rows actor 0 sent since the last step, into samples.jsonl."""
        if self.samples is not None:
            try:
                self.samples.drain_evaluations(self.trainer.step)
            except Exception as exc:  # noqa: BLE001 - never the finish
                log.warning("keeping the evaluation samples failed: %s: %s", type(exc).__name__, exc)

    def _report_finished(self, interrupted: bool) -> None:
        self._drain_evaluation_samples()
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
        self._close_trackers(finished=True)
        self._report_finished(interrupted=False)
        return 0

    # -- spec.tracking ---------------------------------------------------------------------------------------

    def _checkpoint(self) -> None:
        path = self.trainer.save_checkpoint()
        if self.leader:
            self._event(protocol.CHECKPOINT_SAVED, step=self.trainer.step, path=str(path))


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
    return TrainerRole(ctx, client, trainer, stop, document_timeout_s=document_timeout_s,
                       samples=_sample_keeper(ctx, client, trainer, model_dir, leader),
                       trackers=_trackers(ctx, trainer, leader))


def _trackers(ctx: RoleContext, trainer: Trainer, leader: bool) -> Trackers:
    """spec.tracking's sinks (rank 0 only), their run kept under the checkpoint directory, and the job's config
    logged as the run's params (docs/design.md §11)."""
    if not leader or not ctx.spec.tracking.any:
        return Trackers.none()
    directory = Path(trainer.checkpoint_dir or "checkpoints") / TRACKING_DIR
    trackers = build_trackers(ctx.spec.tracking, ctx.namespace, ctx.job, directory, uid=ctx.uid)
    trackers.log_params(job_params(ctx.namespace, ctx.job, ctx.spec))
    return trackers


def _sample_keeper(ctx: RoleContext, client: redis.Redis, trainer: Trainer, model_dir: Path,
                   leader: bool) -> SampleKeeper | None:
    """spec.samples' keeper (None when off): rank 0 writes the tables where the launcher keeps the run's output,
    else beside the checkpoints (docs/design.md §5.7); the tokenizer is loaded at the first table."""
    if ctx.spec.samples.every_steps == 0:
        return None
    tokenizer: list[Any] = []

    def decode(ids: list[int]) -> str:
        if not tokenizer:
            from rlkube.core.hf.tokenizer import Tokenizer

            tokenizer.append(Tokenizer.load(model_dir))
        return tokenizer[0].hf.decode(ids, skip_special_tokens=False)

    return SampleKeeper(ctx.spec.samples, client, ctx.keys, output_dir(ctx.output_dir, trainer.checkpoint_dir),
                        decode, leader=leader, run=ctx.uid)


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
