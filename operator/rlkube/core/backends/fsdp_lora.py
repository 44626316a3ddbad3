"""LoRA under FSDP2 (`spec.trainer.lora` with `sharding: fsdp`): the pieces `FSDPTorchBackend` uses when PEFT
wrapped the model (rlkube.core.training.lora.wrap) before `fully_shard`.

Why PEFT first: the LoRA layers become submodules of the decoder layers, so every layer unit shards its adapter
together with its frozen base weights and gathers both in one all-gather (FSDP2 allows frozen and trained
parameters in one unit); Adam is built over the adapter's shards only.

Start: every rank draws the same fresh adapter from `spec.model.seed` (rlkube.core.training.lora.wrap);
`broadcast_adapter` still gives every rank rank 0's adapter before sharding (what `Trainer.sync_from_leader` does for
the replicated backend), so ranks can never shard parts of different adapters, whatever a PEFT version draws with.

Whole tensors are COLLECTIVES (every rank, same order): `adapter_full` gathers the adapter (small: each A and B's
`DTensor.full_tensor()`), for checkpoints and the native engine's adapter-only update. `MergedWeights` gives the
full weights base + scaling x B @ A under the base's HF names (what vLLM takes): FSDP2 shards W0 [out, in] and
B [out, r] on dim 0 into the same row ranges, so W0's local rows + scaling x B's local rows @ the gathered A are
the merged weight's local rows. A streamed update's checksum is summed from exactly those rows and the tensor sent
is gathered from them, so the two agree bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlkube.core.training import lora as lora_mod


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def broadcast_adapter(peft_model) -> None:
    """COLLECTIVE, before sharding: rank 0's adapter (the trainable parameters) on every rank."""
    for _, p in sorted((n, p) for n, p in peft_model.named_parameters() if p.requires_grad):
        dist.broadcast(p.data, src=0)


def adapter_full(peft_model) -> dict[str, torch.Tensor]:
    """COLLECTIVE: the adapter's full tensors under PEFT's saved names (rlkube.core.training.lora.adapter_state)."""
    return {name: full(t) for name, t in lora_mod.adapter_state(peft_model).items()}


class MergedWeights:
    """The full weights base + adapter of a sharded PeftModel, under the base model's HF names (`hf_names`)."""

    def __init__(self, peft_model, hf_names: list[str]):
        self.names = list(hf_names)
        self.state = {k: v.detach() for k, v in peft_model.get_base_model().state_dict().items()}
        self.scale = lora_mod.scaling_of(peft_model)
        adapter = peft_model.active_adapter
        self._adapted = {}
        for name in self.names:
            module = name[: -len(".weight")]
            a_key = f"{module}.lora_A.{adapter}.weight"
            if name.endswith(".weight") and a_key in self.state:
                self._adapted[name] = (f"{module}.base_layer.weight", a_key, f"{module}.lora_B.{adapter}.weight")

    def reference(self, name: str) -> torch.Tensor:
        """The (sharded) tensor whose shape, dtype and placement the merged weight `name` has."""
        return self.state[self._adapted[name][0]] if name in self._adapted else self.state[name]

    def local(self, name: str) -> torch.Tensor:
        """This rank's rows of the merged weight (COLLECTIVE for an adapted weight: A is gathered)."""
        if name not in self._adapted:
            return local(self.state[name])
        w0, a, b = (self.state[k] for k in self._adapted[name])
        return local(w0).to(torch.float32) + lora_mod.delta(full(a), local(b), self.scale)

    def full(self, name: str) -> torch.Tensor:
        """COLLECTIVE: the merged weight, whole, on every rank."""
        if name not in self._adapted:
            return full(self.state[name])
        ref, rows = self.reference(name), self.local(name)
        if not isinstance(ref, DTensor):
            return rows
        return DTensor.from_local(rows, ref.device_mesh, ref.placements, shape=ref.shape,
                                  stride=ref.stride()).full_tensor()
