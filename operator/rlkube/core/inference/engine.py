"""What the inference shell (rlkube.core.inference.shell) asks of an engine: the one seam between the shell's
weight follower and HTTP server and the engine that holds the model (native or vLLM).

The shell owns everything the two engines share: following the trainer's events stream, the order of an update
(join the announced epoch, receive, put the version in effect), what /health reports, the HTTP routes, shutdown
and the exit code. An engine owns its model: how it joins the weight-update group (one receiver, or one per
vLLM worker), how it receives and loads an update, how it samples, and how its processes stop.

Threads: `join_broadcast`, `join`, `receive_announced`, `apply` and `leave` are called from the follower's thread
(they may block in the group); `start`, `generate`, `stream`, `shutdown` and `close` on the server's event loop;
`version`, `epoch`, `ranks` and `ready` from either (read without a lock).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

from rlkube.core.inference.weight_source import WeightSource
from rlkube.core.inference.openai_api import ServedModel, StreamChunks
from rlkube.core.inference.sampling import GenerationRequest, GenerationResult

RECEIVE_TIMEOUT_S = 120.0  # per collective once an announcement was seen; the trainer sends right after it

PARAMETERS = "parameters"
RECEIVED = "received"
"""Where a served checksum comes from: read back from the served parameters, or of the update as received (and
verified against the trainer's checksum before it was loaded) where the engine cannot read its parameters."""


class UpdateRefused(Exception):
    """The update arrived but was not put in effect; the version served before keeps serving. `fatal`: the engine
    may hold half-loaded weights, so the server must not go on serving them (it exits 1)."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


@dataclass
class Received:
    """An update received and loaded by the engine, not yet in effect (`Engine.apply` makes it so)."""

    version: int
    adapter: bool
    """A LoRA adapter update (rlkube.core.weights ADAPTER), not full weights."""
    checksum: float | None
    """weights_checksum of what will be served, in the dtypes it travelled in (see `checksum_source`)."""
    checksum_source: str
    """PARAMETERS or RECEIVED."""
    transfer_s: float
    load_s: float
    loaded: Any = None
    """What `apply` needs to put it in effect (the engine's own)."""


class Engine(ABC):
    """An inference engine behind the shell."""

    name: ClassVar[str]
    """spec.inference.engine's value for it; /health reports it."""
    served: ServedModel
    source: WeightSource = WeightSource()
    """Where its updates come from, chosen once when it opens (rlkube.core.inference.weight_source): our versioned
    group (the default) or Fast-LLM's broadcast, which is joined at start-up (`join_broadcast`) and whose
    announcements carry no epoch (the step is the version). Stateless: one instance may serve several engines."""
    epoch: str | None
    """The weight-update epoch /health reports: the one joined, None before (and, for our own wire, after) a
    group."""
    fast_llm_generation: str | None = None
    """Fast-LLM only: the generation of the broadcast store the group was joined through (rlkube.contract.
    fast_llm_rendezvous.GENERATION_KEY); an announced other generation means a restarted trainer to rejoin."""
    ranks: list[int]
    """The ranks this server joined the group as (one per tensor-parallel worker)."""
    world_size: int
    """The size of the weight-update group (the trainer's rank 0 included)."""

    def ranks_text(self) -> str:
        """How the join is logged (`joined ... as <this> of <world_size>`): the ranks, one per worker."""
        return f"ranks {self.ranks}"

    @property
    @abstractmethod
    def joined(self) -> bool:
        """Whether it holds a weight-update group now."""

    @property
    @abstractmethod
    def version(self) -> int:
        """The weights version completions are stamped with from now on."""

    def ready(self) -> bool:
        """Whether it can take requests at their expected speed (vLLM warms up first)."""
        return True

    @abstractmethod
    def join_broadcast(self, stop: threading.Event) -> bool:
        """Join Fast-LLM's broadcast group (the FastLlmBroadcast source); False when `stop` was set first. Raises
        WeightSyncError (and has left whatever part of the group it joined)."""

    @abstractmethod
    def join(self, epoch: str) -> None:
        """Leave the group held and join `epoch`'s of our versioned group (blocks until the trainer forms it).
        Raises StaleEpoch (a group this server cannot be part of: the trainer's next announcement will do),
        TransportMismatch or WeightSyncError."""

    @abstractmethod
    def receive_announced(self, step: int) -> Received:
        """Receive the update an announcement (`weights_ready` of `step`) announced and load it, without putting it
        in effect. Its version is the one it carries (our wire), or `step` where the wire carries none (Fast-LLM's
        broadcast). Raises WeightSyncError (the transfer failed; the group is left) or UpdateRefused (it arrived but
        cannot be served)."""

    @abstractmethod
    def apply(self, update: Received) -> None:
        """Serve `update` from now on: completions started from here on carry its version."""

    @abstractmethod
    def leave(self) -> None:
        """Leave the weight-update group (nothing when in none)."""

    @abstractmethod
    def start(self) -> None:
        """Start sampling (called on the server's running event loop, once the routes listen)."""

    @abstractmethod
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """One parsed request; raises EngineStopped (rlkube.core.inference.sampling) once the server is shutting
        down."""

    @abstractmethod
    def stream(self, req: GenerationRequest, chunks: StreamChunks) -> AsyncIterator[dict[str, Any]]:
        """The request's response as server-sent chunks (rlkube.core.inference.openai_api.StreamChunks), usage included
        when asked; raises EngineStopped as `generate` does, before the first chunk."""

    @abstractmethod
    def shutdown(self) -> None:
        """Take no more requests and refuse the waiting ones (does not block: the server's shutdown calls it)."""

    @abstractmethod
    async def close(self) -> str | None:
        """Stop sampling and the engine's processes, within a second or two. None when all stopped, else what is
        still running (the shell then leaves without the interpreter's teardown, as it always does)."""
