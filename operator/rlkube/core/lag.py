"""Lag control shared by every actor replica: a sample-reservation counter in Redis (design.md s5, seed 6.8/6.9).

Why a counter: a rollout must not be consumed more than `maxLag` weight versions after it was sampled. Samples
are consumed in order, `samplesPerStep` per optimizer step, so the r-th sample ever produced is used by the step
that turns version ceil(r/S)-1 into ceil(r/S). Sampling it at version v keeps its lag <= maxLag exactly when

    r <= D + (maxLag + 1) x S        (D = documents the trainer has consumed, S = samplesPerStep)

D is the trainer's `documents_seen` from its latest `weights_ready` (version x S when a trainer does not send
it). Each actor reserves a whole group with one INCRBY; a reservation past the bound is given back and the
actor waits for the next `weights_ready`. The counter is shared, so any number of actor replicas stay within
the bound together.

The announcement comes BEFORE the transfer, so for a moment the actor knows version v while the server still
samples with v-1. The actor therefore checks the bound again with the version that actually sampled the group
(the server's `model_version`, and the documents_seen announced with it) and samples the group again when
that version is too old for the group's reserved number.

Two ways the counter can overcount and would otherwise stall the job forever (seed 6.8):
- a restarted trainer resumes with a smaller D than it had reached (the documents it read after its last
  checkpoint are gone): the first actor that sees the smaller D lowers the counter by the difference, once
  (a Lua script ordered by the event's stream id, so replicas seeing the same event do it only once);
- samples that never reach the trainer (a group dropped by the preprocessor, an actor killed with its
  reservations): when the actors have held for `stall_s` without any new `weights_ready`, one group of credit
  is released per `stall_s` (logged as a warning). Progress never depends on counting exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkube.core import protocol

# Lowers the counter when the trainer's documents_seen went back (a restart), at most once per event.
# KEYS: reserved, last documents_seen, last event id ("ms-seq"); ARGV: event id, documents_seen.
_REBASE = """
local function parse(id)
  local ms, seq = string.match(id, "^(%d+)-(%d+)$")
  return tonumber(ms), tonumber(seq)
end
local last_id = redis.call('GET', KEYS[3])
local ms, seq = parse(ARGV[1])
if last_id then
  local lms, lseq = parse(last_id)
  if ms < lms or (ms == lms and seq <= lseq) then return 0 end
end
local d = tonumber(ARGV[2])
local last_d = tonumber(redis.call('GET', KEYS[2]) or '0')
local lowered = 0
if d < last_d then
  lowered = last_d - d
  redis.call('DECRBY', KEYS[1], lowered)
end
redis.call('SET', KEYS[2], d)
redis.call('SET', KEYS[3], ARGV[1])
return lowered
"""


@dataclass(frozen=True)
class LagKeys:
    reserved: str
    documents_seen: str
    last_event: str
    stall_release: str

    @classmethod
    def for_job(cls, keys: protocol.StreamKeys) -> LagKeys:
        p = keys.prefix + "actor/"
        return cls(p + "samples_reserved", p + "documents_seen", p + "last_event", p + "stall_release")


def sample_budget(documents_seen: int, max_lag: int, samples_per_step: int) -> int:
    """Highest sample number that may be sampled now (pure; see the module docstring)."""
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
    """The shared counter over an asyncio Redis client."""

    def __init__(self, client, keys: protocol.StreamKeys, max_lag: int, samples_per_step: int):
        self.redis = client
        self.keys = LagKeys.for_job(keys)
        self.max_lag = max_lag
        self.samples_per_step = samples_per_step
        self._rebase = client.register_script(_REBASE)

    async def reserve(self, n: int, documents_seen: int) -> int | None:
        """Reserve n samples if they stay within the bound: the number of the last one, or None (nothing
        reserved)."""
        total = int(await self.redis.incrby(self.keys.reserved, n))
        if total <= sample_budget(documents_seen, self.max_lag, self.samples_per_step):
            return total
        await self.redis.decrby(self.keys.reserved, n)
        return None

    async def give_back(self, n: int) -> None:
        await self.redis.decrby(self.keys.reserved, n)

    async def on_weights_ready(self, stream_id: str, documents_seen: int) -> int:
        """Apply a weights_ready event; returns how much the counter was lowered (a trainer restart)."""
        return int(await self._rebase(keys=[self.keys.reserved, self.keys.documents_seen, self.keys.last_event],
                                      args=[stream_id, documents_seen]))

    async def release_if_stalled(self, n: int, stall_s: float) -> bool:
        """Release n samples of credit, at most once per stall_s across all replicas."""
        if await self.redis.set(self.keys.stall_release, "1", nx=True, px=max(1, int(stall_s * 1000))):
            await self.redis.decrby(self.keys.reserved, n)
            return True
        return False

    async def reserved(self) -> int:
        return int(await self.redis.get(self.keys.reserved) or 0)
