"""The preprocessor ROLE (`python -m rlkube.core.preprocessor`): rollout groups -> training documents.

It reads the actors' rollout groups, computes group-relative advantages, and writes one document per sample in
the Fast-LLM streaming format (so the same stream feeds the torch, Megatron and Fast-LLM trainers):
tokens = prompt + completion, `loss_masking_spans` = [[0, len(prompt)]] (the prompt is EXCLUDED from the loss),
sampling log-probs with 0 on the prompt, the policy version per token, the scalar advantage and reward.

Rules it keeps (seed-systems section 6):
- It stops when the trainer publishes `training_finished`, never by counting samples (6.1, 6.2).
- Partial groups are used as they are; a group of one has no baseline (advantage 0) and is dropped (6.10).
- Backpressure: while the trainer's consumer group lags the documents stream by more than
  2 x samplesPerStep entries (XINFO: entries-added - entries-read) it stops reading rollouts, so documents are
  never produced far ahead of the trainer and their policy versions stay fresh.
- Nothing is trimmed from the documents stream (approximate MAXLEN trimming crashed slow readers, 6.12).
- Malformed rollout entries and unknown events are logged and skipped.
- Its read position in the rollouts stream is kept in Redis (`position_key`), written in the same transaction
  as the documents of each group, so a restarted preprocessor continues exactly where it stopped.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import redis

from rlkube.core import protocol
from rlkube.core.advantages import group_advantages
from rlkube.core.runtime import RoleContext

log = logging.getLogger("rlkube.preprocessor")

READ_BLOCK_MS = 1000
HOLD_POLL_MS = 200  # while holding for backpressure: how long each wait on the events stream blocks
READ_COUNT = 16


@dataclass(frozen=True)
class DocumentConfig:
    estimator: str = "leave-one-out"
    normalize: bool = False
    max_length: int | None = None  # the model's maxSequenceLength: longer documents are dropped
    drop_singletons: bool = True  # SFT keeps them: its loss does not use the advantage


def group_to_documents(group: protocol.RolloutGroup, cfg: DocumentConfig) -> list[protocol.Document]:
    """Documents of one rollout group (pure). Samples that are malformed or too long are dropped with a log
    line; the advantages are computed over the samples that remain."""
    prompt = list(group.prompt_tokens)
    samples = []
    for i, s in enumerate(group.samples):
        if not s.completion_tokens:
            log.warning("group %s: sample %d has an empty completion; dropped", group.group_id, i)
        elif len(s.logprobs) != len(s.completion_tokens):
            log.warning("group %s: sample %d has %d log-probs for %d tokens; dropped", group.group_id, i,
                        len(s.logprobs), len(s.completion_tokens))
        elif cfg.max_length is not None and len(prompt) + len(s.completion_tokens) > cfg.max_length:
            log.warning("group %s: sample %d is %d tokens, over maxSequenceLength %d; dropped", group.group_id, i,
                        len(prompt) + len(s.completion_tokens), cfg.max_length)
        else:
            samples.append(s)
    if not samples:
        return []
    if len(samples) == 1 and cfg.drop_singletons:
        log.info("group %s has a single usable sample (no baseline, advantage 0); dropped", group.group_id)
        return []
    if len(samples) < group.expected_size:
        log.info("group %s is partial: %d of %d samples", group.group_id, len(samples), group.expected_size)
    advantages = group_advantages([s.reward for s in samples], cfg.estimator, cfg.normalize)  # type: ignore[arg-type]
    docs = []
    for s, adv in zip(samples, advantages, strict=True):
        tokens = np.asarray(prompt + list(s.completion_tokens), dtype=np.int64)
        old = np.zeros(len(tokens), dtype=np.float32)
        old[len(prompt):] = s.logprobs
        docs.append(
            protocol.Document(
                tokens=tokens,
                loss_masking_spans=[(0, len(prompt))],
                advantage=float(adv),
                reward=float(s.reward),
                old_log_probabilities=old,
                model_version=np.full(len(tokens), group.model_version, dtype=np.int64),
            )
        )
    return docs


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


def position_key(keys: protocol.StreamKeys) -> str:
    """Where the preprocessor keeps its read position in the rollouts stream (the last id it turned into
    documents), so that a restarted preprocessor continues there instead of replaying the stream."""
    return keys.prefix + "preprocessor/rollouts_position"


def _sid(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class PreprocessorRole:
    def __init__(self, ctx: RoleContext, client: redis.Redis, stop: threading.Event | None = None,
                 max_ahead: int | None = None):
        algo = ctx.spec.algorithm
        self.ctx, self.redis, self.keys = ctx, client, ctx.keys
        self.stop = stop or threading.Event()
        self.cfg = DocumentConfig(
            estimator=algo.advantage,
            normalize=algo.normalize_advantage,
            max_length=ctx.spec.model.architecture.max_sequence_length,
            drop_singletons=algo.loss != "sft",
        )
        self.max_ahead = max_ahead if max_ahead is not None else 2 * algo.samples_per_step
        # The rollouts position is persisted (position_key) together with the documents of each entry, so a
        # restarted preprocessor neither replays groups it already wrote nor skips any. Events are re-read from
        # the start on purpose: a training_finished published while we were down must still stop us.
        self.position_key = position_key(self.keys)
        saved = client.get(self.position_key)
        self.rollouts_pos = _sid(saved) if saved else "0-0"
        if saved:
            log.info("continuing the rollouts stream after %s", self.rollouts_pos)
        self.events_pos = "0-0"
        self.finished = False
        self.groups = self.documents = self.skipped = 0
        self.holds = 0

    def _handle_events(self, entries) -> None:
        for sid, fields in entries:
            self.events_pos = _sid(sid)
            event = protocol.decode_event(sid, fields)
            if event is not None and event.type == protocol.TRAINING_FINISHED:
                log.info("training_finished (%s): stopping after %d groups, %d documents", event.stream_id,
                         self.groups, self.documents)
                self.finished = True

    def _handle_rollouts(self, entries) -> None:
        for sid, fields in entries:
            self.rollouts_pos = _sid(sid)
            try:
                group = protocol.RolloutGroup.decode(fields)
            except ValueError as exc:
                self.skipped += 1
                log.warning("skipping rollout entry %s: %s", self.rollouts_pos, exc)
                self.redis.set(self.position_key, self.rollouts_pos)
                continue
            docs = group_to_documents(group, self.cfg)
            # Documents and the position that covers them in one MULTI/EXEC: after a crash either both are
            # there or neither, so every group becomes documents exactly once.
            pipe = self.redis.pipeline(transaction=True)
            for doc in docs:
                pipe.xadd(self.keys.documents, protocol.encode_document(doc))
            pipe.set(self.position_key, self.rollouts_pos)
            pipe.execute()
            self.groups += 1
            self.documents += len(docs)

    def poll(self) -> None:
        """One round: events always; rollouts only while the trainer is not too far behind."""
        got = self.redis.xread({self.keys.events: self.events_pos}, count=100)
        for _, entries in got or []:
            self._handle_events(entries)
        if self.finished:
            return
        room = self.max_ahead - trainer_lag(self.redis, self.keys)
        if room <= 0:
            self.holds += 1
            # Hold, but keep listening: training_finished must still stop us promptly.
            got = self.redis.xread({self.keys.events: self.events_pos}, count=100, block=HOLD_POLL_MS)
            for _, entries in got or []:
                self._handle_events(entries)
            return
        # Read only as many groups as fit in the room left, so the bound is overshot by less than one group.
        count = max(1, min(READ_COUNT, -(-room // self.ctx.spec.algorithm.group_size)))
        got = self.redis.xread({self.keys.events: self.events_pos, self.keys.rollouts: self.rollouts_pos},
                               count=count, block=READ_BLOCK_MS)
        by_stream = {_sid(stream): entries for stream, entries in got or []}
        self._handle_events(by_stream.get(self.keys.events, []))
        if not self.finished:  # documents produced after training_finished would never be read
            self._handle_rollouts(by_stream.get(self.keys.rollouts, []))

    def run(self) -> int:
        log.info("reading %s, writing %s (holding beyond %d unread documents)", self.keys.rollouts,
                 self.keys.documents, self.max_ahead)
        last_report = time.monotonic()
        while not self.finished and not self.stop.is_set():
            self.poll()
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                log.info("%d groups -> %d documents (%d entries skipped)", self.groups, self.documents, self.skipped)
        if not self.finished:
            log.info("stopped by signal after %d groups", self.groups)
        return 0


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s preprocessor %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        ctx = RoleContext.from_env()
        return PreprocessorRole(ctx, redis.Redis.from_url(ctx.redis_url), stop).run()
    except Exception:
        log.exception("preprocessor failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
