"""The preprocessor ROLE (`python -m rlkube.core.preprocessor`): rollout groups -> training documents
(documents.py, the pure conversion), on the job's streams.

Why a role of its own: advantages need a whole group, and one document format (Fast-LLM's) feeds every trainer,
so the actors only sample and the trainers only train. Its contracts: the rollouts it reads and the replicas'
consumer group (docs/design.md §5.3), the documents it writes (§5.4), backpressure (§5.5), advantages and
zero-advantage filtering (§6), and the lag credit it gives back for groups that yield no document (§7). It stops on
`training_finished`, never by counting samples (docs/references.md §6.1, §6.2), and trims nothing (§6.12).
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from rlkube.api.role import Backend
from rlkube.contract import protocol, samples, streams, zero_advantage
from rlkube.core.actor.lag import documents_seen_of
from rlkube.core.preprocessor.documents import DocumentConfig, documents_with_sources, too_long
from rlkube.core.errors import ConfigError
from rlkube.contract.context import RoleContext
from rlkube.core.startup import stop_on_signals

log = logging.getLogger("rlkube.preprocessor")

READ_BLOCK_MS = 500  # also bounds how late training_finished is noticed while waiting for rollouts
HOLD_POLL_MS = 200  # while holding for backpressure: how long each wait on the events stream blocks
READ_COUNT = 16
# An entry pending this long for another consumer belongs to a dead replica: a live one writes an entry
# milliseconds after reading it.
CLAIM_IDLE_MS = 30_000

# Writes one rollout entry's documents and acknowledges the entry, atomically, if the entry is still pending
# for this consumer (another replica may have claimed it while we stalled). Returns 1, or 0 when not ours.
# With it, the samples that became no document are credited back to the actors' lag counters (never below 0)
# and a filtered group is counted.
# With spec.samples each document's record (rlkube.contract.samples.record) goes to the records hash under the
# document's new stream id, in the same step, so the trainer finds it for every document it reads.
# KEYS: rollouts, documents, actors' reserved, actors' written, filtered groups, filtered samples, sample records;
# ARGV: group, consumer, entry id, samples credited, filtered groups (0/1), filtered samples, records (0/1), then
# per document its field count, its fields and (records 1) its record.
_COMMIT = """
local owned = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #owned == 0 then return 0 end
local credit = tonumber(ARGV[4])
if credit > 0 then
  for k = 3, 4 do
    if redis.call('DECRBY', KEYS[k], credit) < 0 then redis.call('SET', KEYS[k], 0) end
  end
end
if tonumber(ARGV[5]) > 0 then
  redis.call('INCRBY', KEYS[5], ARGV[5])
  redis.call('INCRBY', KEYS[6], ARGV[6])
end
local records = tonumber(ARGV[7]) > 0
local i = 8
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, i + 1, i + n))
  i = i + n + 1
  if records then
    redis.call('HSET', KEYS[7], id, ARGV[i])
    i = i + 1
  end
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
return 1
"""


def trainer_lag(client: redis.Redis, keys: protocol.StreamKeys) -> int:
    """Documents written but not yet read by the trainer's group (0 before the group exists)."""
    try:
        added = int(client.xinfo_stream(keys.documents)["entries-added"])
        groups = client.xinfo_groups(keys.documents)
    except redis.ResponseError:  # no documents stream yet
        return 0
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == protocol.DOCUMENTS_GROUP:
            read = g.get("entries-read")
            # entries-read is nil when Redis cannot tell (e.g. after XSETID); fall back to the group's lag.
            return added - int(read) if read is not None else int(g.get("lag") or 0)
    return added  # the trainer has not created its group yet: nothing was read


def _sid(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PreprocessorRole:
    def __init__(self, ctx: RoleContext, client: redis.Redis, stop: threading.Event | None = None,
                 max_ahead: int | None = None, claim_idle_ms: int = CLAIM_IDLE_MS):
        algo = ctx.spec.algorithm
        self.ctx, self.redis, self.keys = ctx, client, ctx.keys
        self.stop = stop or threading.Event()
        self.cfg = DocumentConfig(
            estimator=algo.advantage,
            normalize=algo.normalize_advantage,
            max_length=ctx.spec.model.max_sequence_length,
            drop_singletons=algo.loss != "sft",
            filter_zero_advantage=zero_advantage.filters(ctx.spec),
            documents_per_version=algo.samples_per_step if ctx.spec.trainer.backend == Backend.FAST_LLM else 0,
        )
        # A Fast-LLM trainer reads Fast-LLM's document fields only (protocol.FAST_LLM_DOCUMENT_FIELDS).
        self.ours = ctx.spec.trainer.backend != Backend.FAST_LLM
        # version -> documents_seen of every weights_ready read (model_version's units for Fast-LLM). The events
        # are read after the rollouts, and an actor samples with a version only after its event, so the
        # version of every group read is here.
        self.announced: dict[int, int] = {}
        self.stall_bound = zero_advantage.limit(ctx.spec)
        # Records for the trainer's sample tables (spec.samples); a Fast-LLM trainer reads none (it keeps no samples).
        self.records = ctx.spec.samples.every_steps > 0 and ctx.spec.trainer.backend != Backend.FAST_LLM
        self.filtered_in_a_row = 0  # filtered groups since the last group that became documents
        self.max_ahead = max_ahead if max_ahead is not None else 2 * algo.samples_per_step
        self.consumer = protocol.preprocessor_consumer(ctx.index)
        self.claim_idle_ms = claim_idle_ms
        streams.ensure_group(client, self.keys.rollouts, protocol.ROLLOUTS_GROUP)
        self._commit = client.register_script(_COMMIT)
        # Own pending entries are re-read first (from this id; None once they are all written): entries a
        # previous run of this replica read but died before writing.
        self.pending_from: str | None = "0"
        self.claim_from = "0-0"  # XAUTOCLAIM's cursor through the group's pending entries
        # Events are re-read from the start on purpose: a training_finished published while we were down must
        # still stop us. A Redis error propagates (the role exits and is restarted), as on the rollouts.
        self.events = streams.EventReader(client, self.keys.events, "0-0")
        self.finished = False
        self.groups = self.documents = self.skipped = self.claimed = self.lost = 0
        self.too_long = 0  # samples dropped for exceeding maxSequenceLength
        self.filtered = 0  # zero-advantage groups dropped
        self.credited = 0  # samples that became no document, credited back to the actors' lag counters
        self.holds = 0

    def _read_events(self, block: int | None = None) -> None:
        for event in self.events.read(block_ms=block, count=100):
            if event.type == protocol.WEIGHTS_READY:
                version, seen = documents_seen_of(event.payload, self.ctx.spec.algorithm.samples_per_step)
                self.announced[version] = seen
            if event.type == protocol.TRAINING_FINISHED:
                log.info("training_finished (%s): stopping after %d groups, %d documents", event.stream_id,
                         self.groups, self.documents)
                self.finished = True

    def commit(self, entry_id: str, docs: list[protocol.Document], credit: int = 0, filtered: int = 0,
               records: list[bytes] | None = None) -> bool:
        """Write `docs` and acknowledge rollout entry `entry_id` in one atomic step, if the entry is still
        pending for this consumer; False (nothing written) when another replica has claimed it. With it,
        `credit` samples that became no document go back to the actors' lag counters, a filtered group of
        `filtered` samples is counted, and `records` (one per document) go to the sample records hash."""
        if records is not None and len(records) != len(docs):
            raise ValueError(f"{len(records)} sample records for {len(docs)} documents")
        args: list = [protocol.ROLLOUTS_GROUP, self.consumer, entry_id, credit, int(filtered > 0), filtered,
                      int(records is not None)]
        for i, doc in enumerate(docs):
            fields = protocol.encode_document(doc, ours=self.ours)
            args.append(2 * len(fields))
            for name, value in fields.items():
                args += [name, value]
            if records is not None:
                args.append(records[i])
        keys = [self.keys.rollouts, self.keys.documents, self.keys.actor_samples_reserved,
                self.keys.actor_samples_written, self.keys.filtered_groups, self.keys.filtered_samples,
                self.keys.sample_records]
        return bool(self._commit(keys=keys, args=args))

    def _handle_rollouts(self, entries) -> None:
        for sid, fields in entries:
            sid = _sid(sid)
            group, problem = None, None
            if not fields:  # a pending entry deleted from the stream (XDEL/XTRIM) comes back without fields
                problem = "gone from the stream"
            else:
                try:
                    group = protocol.RolloutGroup.decode(fields)
                except ValueError as exc:
                    problem = str(exc)
            docs, sources, filtered_reward = (documents_with_sources(group, self.cfg, self.announced)
                                              if group is not None
                                              else ([], [], None))
            filtered = filtered_reward is not None
            # Samples the actors counted (lag.write advanced `written` by all of them) that reach no trainer.
            credit = len(group.samples) - len(docs) if group is not None else 0
            records = None
            if self.records and group is not None:
                records = [samples.record(group.group_id, i, group.samples[i].finished, group.samples[i].episode,
                                          group.actor) for i in sources]
            # A skipped entry is acknowledged too (with no documents), or it would be re-read forever.
            if not self.commit(sid, docs, credit, len(group.samples) if filtered else 0, records):
                self.lost += 1
                log.warning("rollout entry %s was claimed by another preprocessor; not writing it", sid)
            elif group is None:
                self.skipped += 1
                log.warning("skipping rollout entry %s: %s", sid, problem)
            else:
                self.groups += 1
                self.documents += len(docs)
                self.too_long += too_long(group, self.cfg)
                self.filtered += int(filtered)
                self.credited += credit
                self._count_stall(filtered_reward, bool(docs))

    def _count_stall(self, filtered_reward: float | None, wrote: bool) -> None:
        """Fail the role (and so the job) once zero-advantage filtering has starved the trainer for
        `stall_bound` groups in a row; groups dropped for other reasons (singletons, too long) neither count nor
        reset the run."""
        if wrote:
            self.filtered_in_a_row = 0
        elif filtered_reward is not None:
            self.filtered_in_a_row += 1
            if self.stall_bound is not None and self.filtered_in_a_row >= self.stall_bound:
                raise ConfigError(zero_advantage.FIELD, zero_advantage.stall(
                    self.filtered_in_a_row, self.stall_bound, filtered_reward, self.documents))

    def _read_rollouts(self, count: int) -> list:
        """Up to `count` rollout entries this replica should process now: its own pending ones first, then
        entries a dead replica left pending, then new ones (blocking up to READ_BLOCK_MS)."""
        try:
            return self._read_rollouts_from_group(count)
        except redis.ResponseError as exc:
            if not protocol.group_lost(exc):
                raise
            # The stream or the group is gone (a Redis that lost its data): start over from its first entry.
            log.warning("%s has no group %s (%s); creating it", self.keys.rollouts, protocol.ROLLOUTS_GROUP, exc)
            streams.ensure_group(self.redis, self.keys.rollouts, protocol.ROLLOUTS_GROUP)
            return []

    def _read_rollouts_from_group(self, count: int) -> list:
        stream = self.keys.rollouts
        if self.pending_from is not None:
            got = self.redis.xreadgroup(protocol.ROLLOUTS_GROUP, self.consumer, {stream: self.pending_from},
                                        count=count)
            entries = [e for _, es in got or [] for e in es]
            if entries:
                self.pending_from = _sid(entries[-1][0])
                log.info("re-processing %d rollout entries this replica had read before it restarted", len(entries))
                return entries
            self.pending_from = None
        cursor, entries, *_ = self.redis.xautoclaim(stream, protocol.ROLLOUTS_GROUP, self.consumer,
                                                    self.claim_idle_ms, start_id=self.claim_from, count=count)
        self.claim_from = _sid(cursor)
        if entries:
            self.claimed += len(entries)
            log.warning("claimed %d rollout entries left pending by another preprocessor for over %d ms",
                        len(entries), self.claim_idle_ms)
            return entries
        got = self.redis.xreadgroup(protocol.ROLLOUTS_GROUP, self.consumer, {stream: ">"}, count=count,
                                    block=READ_BLOCK_MS)
        return [e for _, es in got or [] for e in es]

    def poll(self) -> None:
        """One round: events always; rollouts only while the trainer is not too far behind."""
        self._read_events()
        if self.finished:
            return
        room = self.max_ahead - trainer_lag(self.redis, self.keys)
        if room <= 0:
            self.holds += 1
            # Hold, but keep listening: training_finished must still stop us promptly.
            self._read_events(block=HOLD_POLL_MS)
            return
        # Read only as many groups as fit in the room left, so the bound is overshot by less than one group.
        count = max(1, min(READ_COUNT, -(-room // self.ctx.spec.algorithm.group_size)))
        entries = self._read_rollouts(count)
        if entries:
            self._read_events()  # the read may have blocked: documents written after training_finished are unused
        if not self.finished:  # entries left unwritten stay pending: nothing is lost
            self._handle_rollouts(entries)

    def run(self) -> int:
        log.info("reading %s as %s/%s, writing %s (holding beyond %d unread documents)", self.keys.rollouts,
                 protocol.ROLLOUTS_GROUP, self.consumer, self.keys.documents, self.max_ahead)
        last_report = time.monotonic()
        while not self.finished and not self.stop.is_set():
            self.poll()
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                log.info("%d groups -> %d documents (%d entries skipped, %d claimed, %d samples over "
                         "maxSequenceLength dropped, %d zero-advantage groups filtered, %d samples credited back to "
                         "the actors)", self.groups, self.documents, self.skipped, self.claimed, self.too_long,
                         self.filtered, self.credited)
        if not self.finished:
            log.info("stopped by signal after %d groups", self.groups)
        return 0


def main() -> int:
    stop = stop_on_signals("preprocessor", log)
    try:
        ctx = RoleContext.from_env()
        return PreprocessorRole(ctx, redis.Redis.from_url(ctx.redis_url), stop).run()
    except ConfigError:
        raise  # run_role reports it and exits runtime.EXIT_CONFIG
    except Exception:
        log.exception("preprocessor failed")
        return 1
