"""The trainer's parallel mode, chosen once: one process (`Single`) or a rank of a data-parallel group
(`DataParallelGroup`, over rlkube.core.backends.torch_distributed.DataParallel).

Both offer the same operations, so `Trainer` and `TrainerRole` read top to bottom without asking which mode they
run in: reduce a step's counts and loss statistics, this rank's share of samplesPerStep, agree on stopping, meet the
other ranks, take rank 0's state at start-up. For one process every reduction is the identity and there is nobody
to meet or wait for. What differs between backends (sharded, collective weights) stays a declared capability of
the backend (rlkube.core.backends.base), not a mode here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import fields as dataclass_fields
from typing import Any

import torch

from rlkube.core.backends import TrainerBackend
from rlkube.core.backends.torch_distributed import DataParallel
from rlkube.core.training.losses import LossStats

Counters = tuple[int, int]  # (optimizer steps taken, documents seen)


class Single:
    """One trainer process: it leads, reads every document, and its sums are its own values."""

    dp = None
    has_peers = False
    leader = True
    reads_documents = True

    def consumer_index(self, node_index: int) -> int:
        return node_index

    def share(self, samples_per_step: int) -> int:
        return samples_per_step

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, value: float) -> float:
        return value

    def any(self, flag: bool) -> bool:
        return flag

    def reduce_stats(self, stats: LossStats, gradients: Iterable[torch.nn.Parameter] | None) -> LossStats:
        return stats

    def stopping(self, stop: threading.Event) -> bool:
        return stop.is_set()

    def signal(self, key: str, raised: bool) -> bool:
        """No peers: no flag is ever up for all ranks to act on."""
        return False

    def check_peers(self) -> None:
        pass

    def meet(self, tag: str, while_waiting: Callable[[], Any] | None = None) -> None:
        pass

    def share_with_tensor_peers(self, docs: Any) -> Any:
        return docs

    def sync_from_leader(self, backend: TrainerBackend, counters: Counters, resumed_state: Any,
                         tensor_parallel: bool) -> Counters:
        return counters

    def finish(self) -> None:
        pass


class DataParallelGroup:
    """This rank of the trainer's data-parallel group: sums and maxima over the data-parallel replicas, agreement
    through the group's store, rank 0 leads (events, checkpoints, the weight transfer)."""

    has_peers = True

    def __init__(self, dp: DataParallel):
        self.dp = dp

    @property
    def leader(self) -> bool:
        return self.dp.is_leader

    @property
    def reads_documents(self) -> bool:
        return self.dp.reads_documents

    def consumer_index(self, node_index: int) -> int:
        """docs/design.md §5.4: one consumer per data-parallel replica (tensor-parallel rank 0 reads for it)."""
        return self.dp.data_rank

    def share(self, samples_per_step: int) -> int:
        """This rank's documents per step: samplesPerStep split as evenly as possible (the lower ranks take the
        remainder). Uneven shares are exact too: every rank normalises by the step's global loss-token count."""
        base, extra = divmod(samples_per_step, self.dp.data_size)
        return base + (1 if self.dp.data_rank < extra else 0)

    def sum(self, values: list[float]) -> list[float]:
        return self.dp.sum(values)

    def max(self, value: float) -> float:
        return self.dp.max(value)

    def any(self, flag: bool) -> bool:
        return self.dp.any(flag)

    def reduce_stats(self, stats: LossStats, gradients: Iterable[torch.nn.Parameter] | None) -> LossStats:
        """The step's loss statistics summed over the replicas (its extrema a min or max, rlkube.core.training.losses),
        in one collective with the `gradients` (summed in place); None: a sharded backend reduce-scattered its
        gradients already (torch_fsdp), only the statistics are summed."""
        names = [f.name for f in dataclass_fields(LossStats)]
        pending = [getattr(stats, n) for n in names]
        summed = self.dp.sum(pending) if gradients is None else self.dp.sum_gradients(gradients, pending)
        reduced = dict(zip(names, summed, strict=True))
        for name, how in LossStats.EXTREMA.items():
            sign = -1.0 if how == "min" else 1.0
            reduced[name] = sign * self.dp.max(sign * getattr(stats, name))
        return LossStats(**reduced)

    def stopping(self, stop: threading.Event) -> bool:
        """SIGTERM here (announced to the others), or on another rank: stop after the current step."""
        if stop.is_set():
            self.dp.announce_stop()
            return True
        return self.dp.stop_announced()

    def signal(self, key: str, raised: bool) -> bool:
        """A flag one rank raises in the group's store and every rank sees (no collective: peers may be busy)."""
        if raised:
            self.dp.store.set(key, "1")
            return True
        return self.dp.store.check([key])

    def check_peers(self) -> None:
        self.dp.check_peers()  # a dead peer must not go unnoticed while no documents come

    def meet(self, tag: str, while_waiting: Callable[[], Any] | None = None) -> None:
        self.dp.gather(tag, while_waiting=while_waiting)

    def share_with_tensor_peers(self, docs: Any) -> Any:
        return self.dp.share_with_tensor_peers(docs)

    def sync_from_leader(self, backend: TrainerBackend, counters: Counters, resumed_state: Any,
                         tensor_parallel: bool) -> Counters:
        """Every rank takes rank 0's weights, optimizer state and `counters` (after rank 0 resumed from its
        checkpoint, or fresh), so all ranks start identical however they were initialised. Returns the counters."""
        # Loading a model takes each rank its own time (minutes for a large one): meet in the alive-checked
        # rendezvous, not in the broadcast below, which fails after the collective timeout.
        self.dp.gather("model-loaded")
        if tensor_parallel:
            # Rank 0 holds only its shards; every rank loaded the job's directory, and takes its own shards of what
            # rank 0 resumed from (`resumed_state`: the checkpoint's full tensors), if it resumed.
            resumed, *leaders = self.dp.broadcast_state((resumed_state, *counters) if self.dp.is_leader else None)
            if resumed is not None and not self.dp.is_leader:  # rank 0 loaded it when it resumed
                backend.load_state(*resumed)
            return tuple(leaders)
        state = None
        if self.dp.is_leader:
            model_state, optim_state = backend.state()
            state = (model_state, optim_state, *counters)
        model_state, optim_state, *leaders = self.dp.broadcast_state(state)
        if not self.dp.is_leader:
            backend.load_state(model_state, optim_state)
            return tuple(leaders)
        return counters

    def finish(self) -> None:
        self.dp.finish()  # the other ranks exit only after rank 0's final checkpoint and training_finished


Parallel = Single | DataParallelGroup


def choose(dp: DataParallel | None, layout: Any = None) -> Parallel:
    """The mode for this process: `dp` is its data-parallel group membership (None: one process); `layout` the
    backend's model-parallel groups (megatron tensor parallelism), over whose replicas the sums then run."""
    if dp is None:
        return Single()
    if layout is not None:
        dp.use_layout(layout)
    return DataParallelGroup(dp)
