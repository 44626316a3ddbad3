"""Lag control shared by every actor replica: sample counters in Redis (docs/design.md §7;
docs/references.md §6.8, §6.9).

Why counters: a rollout must not be consumed more than `maxLag` weight versions after it was sampled. Samples
are consumed in stream order, `samplesPerStep` per optimizer step, so the p-th sample written is used by the step
that turns version ceil(p/S)-1 into ceil(p/S). Sampled with version v, its lag stays <= maxLag exactly when

    p <= D_v + (maxLag + 1) x S        (D_v = documents the trainer had consumed at version v, S = samplesPerStep)

D_v is the trainer's `documents_seen` in the `weights_ready` that announced v (v x S when a trainer does not
send it). Two counters, shared by all replicas:
- `reserved` (admission): before sampling, an actor reserves its group with one INCRBY against the newest D; a
  reservation past the bound is given back and the actor holds until the next `weights_ready`. This keeps the
  actors from sampling what could not be used.
- `written` (the stream position): the group is appended by a Lua script that checks the bound for the version
  that actually sampled it at the position it actually gets, then XADDs and advances the counter atomically. A
  group that finished after a later-reserved one, or that a server sampled with weights older than announced
  (the transfer follows the announcement), is refused and sampled again with newer weights. So the bound holds
  in stream order, not just in reservation order.

Two ways the counters can overcount and would otherwise stall the job forever (docs/references.md §6.8):
- a restarted trainer resumes with a smaller D than it had reached (the documents it read after its last
  checkpoint are gone): the first actor that sees the smaller D lowers both counters by the difference, once
  (a Lua script ordered by the event's stream id, so replicas seeing the same event do it only once);
- samples that never reach the trainer (an actor killed with reservations, a group the preprocessor dropped; the
  preprocessor credits the samples of the groups it drops back to both counters as it acknowledges them,
  rlkube.core.preprocessor, so this is the fallback for what it cannot see): when the actors hold, no `weights_ready` came for `stall_s` and less than a step of documents waits for the
  trainer, one replica (once per `stall_s`) first drops the reservations that were never written (safe: the
  write check still holds the bound), or, when there are none, releases one group of credit from both
  counters (logged as a warning). Progress never depends on counting exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from redis.exceptions import ResponseError

from rlkube.contract import counters, protocol

# Lowers the counters when the trainer's documents_seen went back (a restart), at most once per event.
# KEYS: reserved, written, last documents_seen, last event id ("ms-seq"); ARGV: event id, documents_seen.
_REBASE = """
local function parse(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  return tonumber(ms), tonumber(seq)
end
local last_id = redis.call('GET', KEYS[4])
local ms, seq = parse(ARGV[1])
if last_id then
  local lms, lseq = parse(last_id)
  if ms < lms or (ms == lms and seq <= lseq) then return 0 end
end
local d = tonumber(ARGV[2])
local last_d = tonumber(redis.call('GET', KEYS[3]) or '0')
local lowered = 0
if d < last_d then
  lowered = last_d - d
  redis.call('DECRBY', KEYS[1], lowered)
  redis.call('DECRBY', KEYS[2], lowered)
end
redis.call('SET', KEYS[3], d)
redis.call('SET', KEYS[4], ARGV[1])
return lowered
"""

# Appends a group if its last sample's position stays within the budget of the version that sampled it, and adds
# its episode counts to the job's totals in the same step: a reader never sees a group its totals miss, and an
# actor killed between two writes cannot lose the counts of a group it wrote.
# KEYS: written, rollouts stream, episode totals hash; ARGV: n, budget, encoded group, then (field, "i" or "f",
# value) triples. Returns the position, or 0 when refused.
_WRITE = """
local n = tonumber(ARGV[1])
local position = tonumber(redis.call('GET', KEYS[1]) or '0') + n
if position > tonumber(ARGV[2]) then return 0 end
redis.call('XADD', KEYS[2], '*', 'group', ARGV[3])
redis.call('SET', KEYS[1], position)
for i = 4, #ARGV, 3 do
  if ARGV[i + 1] == 'f' then
    redis.call('HINCRBYFLOAT', KEYS[3], ARGV[i], ARGV[i + 2])
  else
    redis.call('HINCRBY', KEYS[3], ARGV[i], ARGV[i + 2])
  end
end
return position
"""


# KEYS: reserved, written; ARGV: n.
_RELEASE = """
local reserved = tonumber(redis.call('GET', KEYS[1]) or '0')
local written = tonumber(redis.call('GET', KEYS[2]) or '0')
local keep = tonumber(ARGV[2])
if reserved > written + keep then
  redis.call('SET', KEYS[1], written + keep)
  return 'unwritten reservations'
end
if keep > 0 then
  return ''
end
redis.call('DECRBY', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], ARGV[1])
return 'one group of credit'
"""



@dataclass(frozen=True)
class LagKeys:
    reserved: str
    written: str
    documents_seen: str
    last_event: str
    stall_release: str

    @classmethod
    def for_job(cls, keys: protocol.StreamKeys) -> LagKeys:
        return cls(keys.actor_samples_reserved, keys.actor_samples_written, keys.actor_documents_seen,
                   keys.actor_last_event, keys.actor_stall_release)


def sample_budget(documents_seen: int, max_lag: int, samples_per_step: int) -> int:
    """Highest sample position that weights announced at `documents_seen` may fill (pure; see above)."""
    return documents_seen + (max_lag + 1) * samples_per_step


def documents_seen_of(payload: dict, samples_per_step: int) -> tuple[int, int]:
    """(version, documents_seen) of a weights_ready payload; documents_seen falls back to version x S."""
    version = payload.get("version", payload.get("step", 0))
    version = int(version) if isinstance(version, int | float) and not isinstance(version, bool) else 0
    seen = payload.get("documents_seen")
    if not isinstance(seen, int | float) or isinstance(seen, bool) or seen <= 0:
        seen = version * samples_per_step
    return version, int(seen)


class LagCounter:
    """The shared counters over an asyncio Redis client."""

    def __init__(self, client, keys: protocol.StreamKeys, max_lag: int, samples_per_step: int):
        self.redis = client
        self.stream_keys = keys
        self.keys = LagKeys.for_job(keys)
        self.max_lag = max_lag
        self.samples_per_step = samples_per_step
        self._rebase = client.register_script(_REBASE)
        self._write = client.register_script(_WRITE)
        self._release = client.register_script(_RELEASE)

    def budget(self, documents_seen: int) -> int:
        return sample_budget(documents_seen, self.max_lag, self.samples_per_step)

    async def reserve(self, n: int, documents_seen: int) -> int | None:
        """Admit n more samples if they stay within the bound: the reserved number of the last one, or None
        (nothing reserved)."""
        total = int(await self.redis.incrby(self.keys.reserved, n))
        if total <= self.budget(documents_seen):
            return total
        await self.redis.decrby(self.keys.reserved, n)
        return None

    async def give_back(self, n: int) -> None:
        """Return an admission whose group will not be written."""
        await self.redis.decrby(self.keys.reserved, n)

    async def write(self, group: protocol.RolloutGroup, documents_seen: int,
                    totals: Mapping[str, int | float] | None = None) -> int | None:
        """XADD the group if it fits the budget of the weights that sampled it (announced at documents_seen), and
        add `totals` (its episode counts) to the job's in the same script: its position, or None when it would be
        consumed too late (sample it again with newer weights; nothing is counted)."""
        fields = group.encode()
        # HINCRBY or HINCRBYFLOAT by each counter's name, never by a value's Python type (rlkube.contract.counters)
        counted = counters.script_args(totals or {})
        position = int(await self._write(keys=[self.keys.written, self.stream_keys.rollouts,
                                               self.stream_keys.episodes],
                                         args=[len(group.samples), self.budget(documents_seen), fields["group"],
                                               *counted]))
        return position or None

    async def on_weights_ready(self, stream_id: str, documents_seen: int) -> int:
        """Apply a weights_ready event; returns how much the counters were lowered (a trainer restart)."""
        return int(await self._rebase(
            keys=[self.keys.reserved, self.keys.written, self.keys.documents_seen, self.keys.last_event],
            args=[stream_id, documents_seen]))

    async def trainer_starving(self) -> bool:
        """Whether fewer than one step of documents waits for the trainer's consumer group."""
        docs = self.stream_keys.documents
        try:
            added = int((await self.redis.xinfo_stream(docs))["entries-added"])
            groups = await self.redis.xinfo_groups(docs)
        except ResponseError:  # no documents stream yet
            return True
        for g in groups:
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == protocol.DOCUMENTS_GROUP:
                read = g.get("entries-read")
                waiting = added - int(read) if read is not None else int(g.get("lag") or 0)
                return waiting < self.samples_per_step
        return added < self.samples_per_step

    async def release_if_stalled(self, n: int, stall_s: float, inflight: int = 0) -> str | None:
        """Unblock a stalled pipeline, at most once per stall_s across all replicas. First drops reservations
        that were never written (an actor killed mid-group: safe, the write check still holds the bound),
        except the `inflight` samples this replica is sampling right now (a slow group is not a lost one);
        when there are none and nothing is in flight here, lowers both counters by n (samples the preprocessor
        dropped: the bound may be exceeded by those n). Returns what it did, or None."""
        if not await self.redis.set(self.keys.stall_release, "1", nx=True, px=max(1, int(stall_s * 1000))):
            return None
        did = protocol.text(await self._release(keys=[self.keys.reserved, self.keys.written], args=[n, inflight]))
        return did or None

    async def reserved(self) -> int:
        return int(await self.redis.get(self.keys.reserved) or 0)

    async def written(self) -> int:
        return int(await self.redis.get(self.keys.written) or 0)
