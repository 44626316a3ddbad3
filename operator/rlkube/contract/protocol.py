"""The Redis wire contract shared by the operator and every pod (docs/design.md §5).

One module so the operator's event watcher and the trainer that writes those events cannot drift apart.
Pure encode/decode functions plus the key layout; the Redis calls themselves live with their callers.

Keys are namespaced `{namespace}/{job}/...`, except for Fast-LLM trainers whose stream names are fixed
(such a job gets its own managed Redis, so the bare names cannot collide).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from rlkube.api.role import Backend

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

# Fast-LLM's fixed names; ours reuse them under the per-job prefix.
EVENTS_STREAM = "fast_llm_events"
DOCUMENTS_STREAM = "fast_llm_streaming"
DOCUMENTS_GROUP = "fast_llm_group"
ROLLOUTS_STREAM = "rollouts"
ROLLOUTS_GROUP = "preprocessor"  # consumer group of the preprocessor replicas on the rollouts stream
EVENT_FIELD = "event"

WEIGHTS_READY = "weights_ready"
TRAINING_FINISHED = "training_finished"
CHECKPOINT_SAVED = "checkpoint_saved"
METRICS = "metrics"
EVALUATION = "evaluation"  # written by actor 0, not the trainer (spec.evaluation, rlkube.core.actor.evaluation)
# A tracker (spec.tracking) that failed in the trainer: {"type", "tracker", "message"}, once per tracker and trainer
# process; the launchers report it as the condition TrackerFailed (rlkube.core.tracking).
TRACKER_FAILED = "tracker_failed"
# A Fast-LLM trainer pod's launcher opened a new weight-broadcast store: {"type", "generation"}, before Fast-LLM
# starts; receivers in an older generation's group join the new one (rlkube.contract.fast_llm_rendezvous).
BROADCAST_OPENED = "broadcast_opened"
EVENT_TYPES = (WEIGHTS_READY, TRAINING_FINISHED, CHECKPOINT_SAVED, METRICS, EVALUATION, TRACKER_FAILED,
               BROADCAST_OPENED)


def consumer_name(rank: int) -> str:
    return f"fast_llm_consumer_{rank}"


def preprocessor_consumer(index: int) -> str:
    """Consumer of preprocessor replica `index` in ROLLOUTS_GROUP: stable across restarts of that replica, so
    a restarted one finds the entries it had read but not yet acknowledged."""
    return f"preprocessor-{index}"


@dataclass(frozen=True)
class StreamKeys:
    """Every Redis key of one job. Roles take their key names from here and never build them themselves, so
    `all()` (what the operator deletes from an external Redis at teardown) cannot miss one."""

    prefix: str

    @classmethod
    def for_job(cls, namespace: str, job: str, backend: str = "torch") -> StreamKeys:
        return cls("" if backend == Backend.FAST_LLM else f"{namespace}/{job}/")

    @property
    def events(self) -> str:
        return self.prefix + EVENTS_STREAM

    @property
    def documents(self) -> str:
        return self.prefix + DOCUMENTS_STREAM

    @property
    def rollouts(self) -> str:
        return self.prefix + ROLLOUTS_STREAM

    # The actors' lag counters (rlkube.core.actor.lag), shared by every actor replica.
    @property
    def actor_samples_reserved(self) -> str:
        return self.prefix + "actor/samples_reserved"

    @property
    def actor_samples_written(self) -> str:
        return self.prefix + "actor/samples_written"

    @property
    def actor_documents_seen(self) -> str:
        return self.prefix + "actor/documents_seen"

    @property
    def actor_last_event(self) -> str:
        return self.prefix + "actor/last_event"

    @property
    def actor_stall_release(self) -> str:
        return self.prefix + "actor/stall_release"

    # The preprocessors' counts of zero-advantage groups dropped before training (spec.algorithm.
    # filterZeroAdvantageGroups), and of their samples; the trainer reports them in its metrics.
    @property
    def filtered_groups(self) -> str:
        return self.prefix + "preprocessor/filtered_groups"

    @property
    def filtered_samples(self) -> str:
        return self.prefix + "preprocessor/filtered_samples"

    # The actors' counts of multi-turn episodes (a hash: episodes, turns, tool_calls, tool_errors, tool_timeouts,
    # sandbox_refusals, truncated, timed_out, drifted, turn_rewards, turn_reward_sum), whole job; the trainer
    # reports them in its metrics.
    @property
    def episodes(self) -> str:
        return self.prefix + "actor/episodes"

    # The weight versions whose evaluation (spec.evaluation) an actor has claimed (a set): each is scored once,
    # also across actor restarts.
    @property
    def evaluated(self) -> str:
        return self.prefix + "actor/evaluated"

    # Rollout samples kept for people (spec.samples, rlkube.contract.samples): the preprocessor's record of each
    # training document, what the document cannot carry (a hash: document stream id -> JSON), deleted by the trainer
    # once it read the document; and actor 0's evaluation samples (a stream, one entry per evaluated version).
    @property
    def sample_records(self) -> str:
        return self.prefix + "preprocessor/sample_records"

    @property
    def evaluation_samples(self) -> str:
        return self.prefix + "actor/evaluation_samples"

    def all(self) -> list[str]:
        """Every key any role creates (streams with their consumer groups, counters)."""
        return [self.events, self.documents, self.rollouts, self.actor_samples_reserved, self.actor_samples_written,
                self.actor_documents_seen, self.actor_last_event, self.actor_stall_release, self.filtered_groups,
                self.filtered_samples, self.episodes, self.evaluated, self.sample_records, self.evaluation_samples]


# --- trainer events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerEvent:
    """One decoded entry of the events stream. `payload` keeps every field the producer sent."""

    stream_id: str
    type: str
    payload: dict[str, Any]

    @property
    def step(self) -> int | None:
        """The payload's `step` as an int; None when absent, not a number, or beyond int64 (a status field)."""
        return as_int64(self.payload.get("step"))

    @property
    def time(self) -> float:
        """When Redis added the entry (the id's millisecond clock), in seconds since the epoch: times steps
        without trusting the pods' clocks."""
        return stream_id_key(self.stream_id)[0] / 1000


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def as_int64(value: Any) -> int | None:
    """A JSON number as an int if it fits int64 (what a Kubernetes integer field holds), else None. JSON numbers
    from a producer can be anything: 1e308 parses as a float whose int() has 309 digits."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    number = int(value)
    return number if INT64_MIN <= number <= INT64_MAX else None


def as_finite_float(value: Any) -> float | None:
    """A JSON number as a finite float, else None: a bool, NaN, an infinity or an int past float's range (a
    producer's 10**400 would make float() raise) is no number a reader can report."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def stream_id_key(stream_id: str | None) -> tuple[int, int]:
    """Sort key of a stream id; None sorts first (like `0-0`)."""
    if not stream_id:
        return (0, 0)
    ms, _, seq = stream_id.partition("-")
    return (int(ms), int(seq or 0))


def encode_event(type_: str, **fields: Any) -> dict[str, bytes]:
    """XADD field map of an event: `{"event": JSON}` with `type` first, as Fast-LLM writes it."""
    return {EVENT_FIELD: orjson.dumps({"type": type_, **fields})}


def weights_ready(step: int, documents_seen: int, **extra: Any) -> dict[str, bytes]:
    return encode_event(WEIGHTS_READY, step=step, documents_seen=documents_seen, **extra)


def training_finished(**extra: Any) -> dict[str, bytes]:
    """Fast-LLM sends only {"type"}; our trainers add `step` and `checkpoint` (the completion evidence)."""
    return encode_event(TRAINING_FINISHED, **extra)


def text(value: Any) -> str:
    """A Redis reply field (bytes or str) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def group_lost(error: Exception) -> bool:
    """Whether a consumer-group read failed because the stream or its group is gone (a Redis that restarted
    empty): NOGROUP, or UNBLOCKED when the key was removed while the read was blocked on it."""
    return str(error).startswith(("NOGROUP", "UNBLOCKED"))


def decode_event(stream_id: Any, fields: dict[Any, Any]) -> TrainerEvent | None:
    """Decode one stream entry; None (with a log line) for a malformed or unknown entry, which callers skip."""
    sid = text(stream_id)
    raw = fields.get(EVENT_FIELD, fields.get(EVENT_FIELD.encode()))
    if raw is None:
        log.warning("skipping event %s: no %r field (fields: %s)", sid, EVENT_FIELD, list(fields))
        return None
    try:
        payload = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        log.warning("skipping event %s: not JSON (%s)", sid, exc)
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("type"), str):
        log.warning("skipping event %s: no string `type` in %r", sid, payload)
        return None
    if payload["type"] not in EVENT_TYPES:
        log.info("ignoring event %s of unknown type %r", sid, payload["type"])
        return None
    return TrainerEvent(sid, payload["type"], payload)


# --- training documents (preprocessor -> trainer), Fast-LLM streaming format ------------------------
# numpy is imported where documents are built or read: the operator imports this module for the keys and the
# events, and its install has no numpy (the training stack is the `core` extra).


@dataclass
class Document:
    """One training sample. `loss_masking_spans` are [begin, end) token spans EXCLUDED from the loss."""

    tokens: np.ndarray  # int64
    loss_masking_spans: list[tuple[int, int]] = field(default_factory=list)
    advantage: float = 0.0
    reward: float = 0.0
    old_log_probabilities: np.ndarray | None = None  # float32, one per token (0 on the prompt)
    model_version: np.ndarray | None = None  # int64, one per token
    reward_error: bool = False  # the reward function failed on this sample (it scored 0); counted in metrics
    # Where the trainer read it (the documents stream's entry id): in-process only, never encoded (Fast-LLM's
    # documents keep their shape); keys the document's record in StreamKeys.sample_records.
    stream_id: str | None = None

    def loss_mask(self) -> np.ndarray:
        """Boolean per token: True where the token counts in the loss."""
        import numpy as np

        mask = np.ones(len(self.tokens), dtype=bool)
        for begin, end in self.loss_masking_spans:
            mask[begin:end] = False
        return mask


FAST_LLM_DOCUMENT_FIELDS = ("tokens", "loss_masking_spans", "chosen_span", "rejected_span", "advantage",
                            "old_log_probabilities", "reward", "model_version")
"""What Fast-LLM's streaming dataset accepts in a document (RedisStreamingDocumentData; the record and its lines are
in tests/fixtures/fast_llm_config_fields.json, `document`): every stream field but `data` and every key of the
`data` JSON becomes a keyword of a strict from_dict, so anything else fails the trainer ("Unknown field")."""
OUR_DOCUMENT_KEYS = ("reward_error",)
"""Keys of `data` only our trainers read; never written to a Fast-LLM trainer's documents (encode_document)."""


def encode_document(doc: Document, *, ours: bool = True) -> dict[str, bytes]:
    """The stream entry of a document. `ours` adds OUR_DOCUMENT_KEYS for our trainers; without it the entry
    holds only FAST_LLM_DOCUMENT_FIELDS (what the preprocessor writes for a Fast-LLM trainer)."""
    import numpy as np

    n = len(doc.tokens)
    data: dict[str, Any] = {
        "loss_masking_spans": [[int(b), int(e)] for b, e in doc.loss_masking_spans],
        "advantage": float(doc.advantage),
        "reward": float(doc.reward),
    }
    if doc.reward_error and ours:
        data["reward_error"] = True  # our key, only when set (a Fast-LLM trainer's documents never hold it)
    fields: dict[str, bytes] = {
        "tokens": np.asarray(doc.tokens, dtype="<i8").tobytes(),
        "data": orjson.dumps(data),
    }
    if doc.old_log_probabilities is not None:
        if len(doc.old_log_probabilities) != n:
            raise ValueError("old_log_probabilities needs one value per token")
        fields["old_log_probabilities"] = np.asarray(doc.old_log_probabilities, dtype="<f4").tobytes()
    if doc.model_version is not None:
        if len(doc.model_version) != n:
            raise ValueError("model_version needs one value per token")
        fields["model_version"] = np.asarray(doc.model_version, dtype="<i8").tobytes()
    return fields


def _field(fields: dict[Any, Any], name: str) -> Any:
    return fields.get(name, fields.get(name.encode()))


def decode_document(fields: dict[Any, Any]) -> Document:
    """Inverse of encode_document; raises ValueError on a malformed entry."""
    import numpy as np

    tokens_raw = _field(fields, "tokens")
    data_raw = _field(fields, "data")
    if tokens_raw is None or data_raw is None:
        raise ValueError(f"document lacks tokens or data (fields: {list(fields)})")
    if len(tokens_raw) % 8:
        raise ValueError("tokens is not a whole number of int64 values")
    tokens = np.frombuffer(tokens_raw, dtype="<i8").astype(np.int64)
    try:
        data = orjson.loads(data_raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"data is not JSON: {exc}") from None
    spans = [(int(b), int(e)) for b, e in data.get("loss_masking_spans", [])]
    for b, e in spans:
        if not 0 <= b <= e <= len(tokens):
            raise ValueError(f"loss masking span {(b, e)} outside {len(tokens)} tokens")
    old = _field(fields, "old_log_probabilities")
    ver = _field(fields, "model_version")
    doc = Document(
        tokens=tokens,
        loss_masking_spans=spans,
        advantage=float(data.get("advantage", 0.0)),
        reward=float(data.get("reward", 0.0)),
        old_log_probabilities=None if old is None else np.frombuffer(old, dtype="<f4").astype(np.float32),
        model_version=None if ver is None else np.frombuffer(ver, dtype="<i8").astype(np.int64),
        reward_error=bool(data.get("reward_error", False)),
    )
    for name in ("old_log_probabilities", "model_version"):
        arr = getattr(doc, name)
        if arr is not None and len(arr) != len(tokens):
            raise ValueError(f"{name} has {len(arr)} values for {len(tokens)} tokens")
    return doc


# --- rollouts (actor -> preprocessor) ------------------------------------------------------------


@dataclass
class Sample:
    """One completion, or one multi-turn episode (rlkube.core.actor.episodes): then `completion_tokens` is every token
    after the prompt in order (the model's replies and the environment's answers), `env_spans` the [begin, end)
    spans of it the environment wrote (log-prob 0, excluded from the loss), `versions` the weight version that
    sampled each token (the group's `model_version` when None) and `episode` its counts (turns, tool_calls,
    tool_errors, tool_timeouts, sandbox_refusals, truncated, timed_out, drifted, turn_rewards) and
    turn_reward_sum, the sum of its per-turn rewards (a float)."""

    completion_tokens: list[int]
    logprobs: list[float]  # sampling log-prob of each completion token
    reward: float
    finished: bool = True
    reward_error: bool = False  # the reward failed on this completion: `reward` is 0, not a score
    env_spans: list[tuple[int, int]] | None = None
    versions: list[int] | None = None
    episode: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        """The entry's form: the episode fields only when set, so single-turn entries keep their shape."""
        return {k: v for k, v in self.__dict__.items()
                if v is not None or k not in ("env_spans", "versions", "episode")}


@dataclass
class RolloutGroup:
    """One entry per finished group. `model_version` is the policy version stamped when sampling started."""

    group_id: str
    prompt_tokens: list[int]
    samples: list[Sample]
    model_version: int
    expected_size: int
    actor: str = ""
    created_at: float = 0.0

    def encode(self) -> dict[str, bytes]:
        return {
            "group": orjson.dumps(
                {
                    "group_id": self.group_id,
                    "prompt_tokens": self.prompt_tokens,
                    "samples": [s.to_json() for s in self.samples],
                    "model_version": self.model_version,
                    "expected_size": self.expected_size,
                    "actor": self.actor,
                    "created_at": self.created_at,
                }
            )
        }

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> RolloutGroup:
        raw = _field(fields, "group")
        if raw is None:
            raise ValueError(f"rollout entry lacks `group` (fields: {list(fields)})")
        try:
            d = orjson.loads(raw)
            return cls(
                group_id=str(d["group_id"]),
                prompt_tokens=[int(t) for t in d["prompt_tokens"]],
                samples=[_sample(s) for s in d["samples"]],
                model_version=int(d["model_version"]),
                expected_size=int(d.get("expected_size", len(d["samples"]))),
                actor=str(d.get("actor", "")),
                created_at=float(d.get("created_at", 0.0)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed rollout entry: {exc}") from None


def _sample(d: dict[str, Any]) -> Sample:
    sample = Sample(**d)
    if sample.env_spans is not None:
        sample.env_spans = [(int(b), int(e)) for b, e in sample.env_spans]
    return sample
