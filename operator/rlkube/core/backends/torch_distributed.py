"""Data parallelism for the trainer role over torch.distributed: one process per trainer node (pod), gloo on CPU,
NCCL on GPUs, the same code either way.

Why it is not DistributedDataParallel: DDP all-reduces during every backward (a step here is many micro-batches)
and AVERAGES over ranks, while our loss is a sum over the step's loss tokens divided by the step's global
loss-token count; it also wraps the model (state_dict names gain `module.`, which the checkpoints and the weight
transfer must not see). So the trainer sums the local loss-token counts first (one tiny all_reduce), every rank
divides its loss by that global count, and after the last micro-batch ONE all_reduce(SUM) of the flattened
gradients (with the step's loss statistics appended) gives every rank exactly the single-process gradient of the
union of the step's documents. Clipping and Adam then run identically on every rank.

Why waiting is not done inside collectives: a collective fails after the collective timeout
(RLKUBE_COLLECTIVE_TIMEOUT_S, default 120 s), and ranks can legitimately be apart for much longer: one rank waits
for its share of documents while another has its share, or rank 0 is in a weight transfer to inference servers
that are still loading. So ranks first meet in `gather(tag)`, a rendezvous on the TCPStore hosted by rank 0 that
waits as long as every peer is alive: each rank bumps a heartbeat counter in the store every second from a
thread, and a peer whose counter has not moved for the collective timeout is declared dead (PeerLost). Only then
do they enter the collectives, which take milliseconds. Rank 0 dying takes its store with it: the others' next
store call fails at once. A rank stopped by SIGTERM sets the store's stop key, which every rank's document wait
sees within a second, so all ranks agree (one all_reduce of the flags) to stop after the same step.

Model parallelism (the megatron backend's tensor parallelism, `use_layout`): the trainer's ranks then form
data-parallel replicas of TP ranks each. The sums of documents, tokens, loss statistics and gradients (`sum`,
`max`, `sum_gradients`) run over the data-parallel group only (tensor-parallel peers train the same documents, so
summing over every rank would count them TP times); rendezvous, stop flags and broadcasts stay over all ranks.
`data_rank` / `data_size` say which share of a step's documents a rank trains; tensor-parallel rank 0 of each
replica reads them and hands them to its peers (`share_with_tensor_peers`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlkube.contract.runtime import ENV_COLLECTIVE_TIMEOUT

log = logging.getLogger("rlkube.trainer.dp")

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0
START_TIMEOUT_S = 600.0  # how long ranks wait for a peer that has not connected yet (pods start minutes apart)
HEARTBEAT_S = 1.0
POLL_S = 0.01  # how often a rank in gather() looks whether the others arrived (latency added to every step)
PEER_CHECK_S = 0.5  # how often it looks at their heartbeats meanwhile (2 store calls per peer)


class PeerLost(RuntimeError):
    """Another trainer rank stopped answering (died, or hung) for longer than the collective timeout."""


@dataclass(frozen=True)
class DistConfig:
    """torchrun's environment, as the operator and `rlkube local` set it for every trainer pod/process."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DistConfig:
        env = os.environ if env is None else env

        def number(name: str, default: str | None = None, kind=int):
            raw = env.get(name, default)
            if raw is None or raw == "":
                raise ValueError(f"{name} is not set: a trainer with spec.trainer.nodes > 1 needs torchrun's env")
            try:
                return kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None

        cfg = cls(rank=number("RANK"), world_size=number("WORLD_SIZE"), master_addr=env.get("MASTER_ADDR") or "",
                  master_port=number("MASTER_PORT"), local_rank=number("LOCAL_RANK", "0"),
                  timeout_s=number(ENV_COLLECTIVE_TIMEOUT, str(DEFAULT_COLLECTIVE_TIMEOUT_S), float))
        if not cfg.master_addr:
            raise ValueError("MASTER_ADDR is not set: a trainer with spec.trainer.nodes > 1 needs torchrun's env")
        if not 0 <= cfg.rank < cfg.world_size:
            raise ValueError(f"RANK={cfg.rank} is outside WORLD_SIZE={cfg.world_size}")
        if not cfg.timeout_s > 0:
            raise ValueError(f"{ENV_COLLECTIVE_TIMEOUT}={cfg.timeout_s!r} must be > 0 seconds")
        return cfg


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class DataParallel:
    """This process's membership in the trainer's data-parallel group (the default torch.distributed group)."""

    def __init__(self, cfg: DistConfig, device: str = "cpu"):
        self.cfg = cfg
        self.rank, self.world_size = cfg.rank, cfg.world_size
        self.device = torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.store = dist.TCPStore(cfg.master_addr, cfg.master_port, cfg.world_size, cfg.rank == 0,
                                   timeout=datetime.timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False)
        # A rank restarted alone (its pod replaced) finds rank 0's store still running a group it can no longer
        # join: both must fail at once (and restart together) instead of the new one's heartbeat keeping rank 0
        # waiting for a rank that will never arrive where the old one left.
        if self.store.add(f"incarnation/{cfg.rank}", 1) > 1:
            raise PeerLost(f"trainer rank {cfg.rank} started again while rank 0 ({cfg.master_addr}) still runs the "
                           "group it left; exiting so that every rank restarts")
        self._incarnations: dict[int, int] = {}
        self._closing = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="dp-heartbeat", daemon=True)
        self._beat.start()
        self._stop_announced = False
        self._seen: dict[int, tuple[int, float]] = {}  # peer rank -> (heartbeat count, when it last changed)
        # Without model parallelism every rank is its own data-parallel replica (use_layout changes this).
        self.data_rank, self.data_size, self.data_group = cfg.rank, cfg.world_size, None
        self.tensor_parallel, self.tensor_rank, self.tensor_group, self.tensor_source = 1, 0, None, cfg.rank
        # Meet before init_process_group: its own rendezvous would fail after the collective timeout while a peer
        # pod is still starting.
        self.gather("start")
        dist.init_process_group(self.backend, store=dist.PrefixStore("dp", self.store), rank=cfg.rank,
                                world_size=cfg.world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s))
        log.info("rank %d/%d joined the data-parallel group (%s, collective timeout %gs)", cfg.rank,
                 cfg.world_size, self.backend, cfg.timeout_s)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def use_layout(self, layout) -> None:
        """Model parallelism: `layout` (rlkube.core.backends.megatron_backend.ParallelLayout) names this rank's
        data-parallel and tensor-parallel groups (module docstring)."""
        self.data_rank, self.data_size, self.data_group = layout.data_rank, layout.data_parallel, layout.data_group
        self.tensor_parallel, self.tensor_rank = layout.tensor_parallel, layout.tensor_rank
        self.tensor_group, self.tensor_source = layout.tensor_group, layout.tensor_source

    @property
    def reads_documents(self) -> bool:
        """This rank reads its replica's documents (tensor-parallel peers get them from it)."""
        return self.tensor_rank == 0

    def share_with_tensor_peers(self, docs: Any) -> Any:
        """Tensor-parallel rank 0's `docs` on every rank of its tensor-parallel group (a collective)."""
        if self.tensor_parallel == 1:
            return docs
        box = [docs if self.reads_documents else None]
        dist.broadcast_object_list(box, src=self.tensor_source, group=self.tensor_group,
                                   device=self.device if self.backend == "nccl" else None)
        return box[0]

    # --- liveness and rendezvous (store) ---

    def _heartbeat(self) -> None:
        while not self._closing.wait(HEARTBEAT_S):
            try:
                self.store.add(f"hb/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 exited): gather() reports it
                return

    def check_peers(self) -> None:
        """PeerLost when another rank's heartbeat has not moved for the collective timeout (START_TIMEOUT_S
        before its first beat). Cheap (one store call per peer): called while waiting for documents too."""
        now = time.monotonic()
        for r in range(self.world_size):
            if r == self.rank:
                continue
            incarnation = self.store.add(f"incarnation/{r}", 0)
            known = self._incarnations.get(r, 0)  # 0 until the peer registered
            if not known:
                self._incarnations[r] = incarnation
            elif incarnation > known:
                raise PeerLost(f"trainer rank {r} restarted (its process was replaced); rank {self.rank} gives up")
            beats = self.store.add(f"hb/{r}", 0)
            last = self._seen.get(r)
            if last is None or last[0] != beats:
                self._seen[r] = (beats, now)
                continue
            limit = START_TIMEOUT_S if beats == 0 else self.cfg.timeout_s
            if now - last[1] > limit:
                raise PeerLost(f"trainer rank {r} has shown no sign of life for {limit:g}s "
                               f"({ENV_COLLECTIVE_TIMEOUT}); rank {self.rank} gives up")

    def gather(self, tag: str, while_waiting=None) -> None:
        """Wait until every rank reached `tag`, for as long as the missing ranks are alive (check_peers);
        `while_waiting()` is called as often as the peers are checked."""
        self.store.add(f"hb/{self.rank}", 1)
        self.store.set(f"at/{tag}/{self.rank}", "1")
        keys = [f"at/{tag}/{r}" for r in range(self.world_size)]
        checked = time.monotonic()
        while not self.store.check(keys):
            if time.monotonic() - checked > PEER_CHECK_S:
                self.check_peers()
                if while_waiting is not None:
                    while_waiting()
                checked = time.monotonic()
            time.sleep(POLL_S)

    def announce_stop(self) -> None:
        """Tell the other ranks (through the store) to stop after the current step."""
        if not self._stop_announced:
            self._stop_announced = True
            self.store.set("stop", "1")

    def stop_announced(self) -> bool:
        return self._stop_announced or self.store.check(["stop"])

    # --- collectives ---

    def any(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def max(self, value: float) -> float:
        """The maximum over the data-parallel replicas."""
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.data_group)
        return t.item()

    def sum(self, values: list[float]) -> list[float]:
        """The sums over the data-parallel replicas."""
        # float64: exact for counts; one collective for all of them
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.data_group)
        return t.tolist()

    def sum_gradients(self, params: Iterable[torch.nn.Parameter], extra: list[float]) -> list[float]:
        """Sum every parameter's gradient over the data-parallel replicas in place (one flat all_reduce), together
        with `extra` (returned summed). A missing gradient counts as zeros so that every rank sends the same
        layout. (With tensor parallelism `params` are this rank's shards, summed with the same shards.)"""
        params = [p for p in params if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        dtype = grads[0].dtype if grads else torch.float32
        flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor(extra, dtype=dtype, device=self.device)])
        dist.all_reduce(flat, group=self.data_group)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        return flat[offset:].double().tolist()

    def broadcast_state(self, state: Any) -> Any:
        """Rank 0's `state` (any picklable object; tensors travel via CPU) on every rank."""
        box = [_to_cpu(state) if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self.device if self.backend == "nccl" else None)
        return box[0]

    # --- the end ---

    def finish(self) -> None:
        """Every rank calls this last: waits (alive-checked) for rank 0's final checkpoint and events, then one
        barrier so that rank 0 (which hosts the store) exits only after everyone stopped using it."""
        self.gather("done")
        self._closing.set()
        dist.barrier()
        self.close()
        log.info("rank %d left the data-parallel group after rank 0 finished", self.rank)

    def close(self) -> None:
        self._closing.set()
        if dist.is_initialized():
            dist.destroy_process_group()
