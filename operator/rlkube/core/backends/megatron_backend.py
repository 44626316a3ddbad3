"""The `megatron` backend: a megatron-core GPTModel of the job's architecture behind the Trainer API.

`spec.trainer.backend: megatron` (image trainer-megatron, extra `rlkube[megatron]`) trains a megatron-core
(0.16.1) `GPTModel` built from megatron's local layer spec with the job's architecture, on CPU through the shim in
`megatron_cpu` or on one GPU. Same losses (`base.batch_loss`), same optimizer (Adam with gradient clipping,
zeroed after the step), and the same checkpoint and weight formats as the torch backend: weights and Adam moments
are converted to TinyLM's names and layout at the edge (`megatron_layout`), so the native inference server
receives the weights it already knows, and a checkpoint written by either backend resumes on the other.

The initial weights are the job's model (`builtin://tiny-lm` seeded, or a saved directory) loaded into the
GPTModel, so the trainer starts from exactly the weights every inference server built for itself.

One rank: tensor and pipeline parallel size 1 (the trainer role trains on one node); megatron's distributed
optimizer and data-parallel wrappers are not used.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.core.backends import megatron_cpu
from rlkube.core.backends.base import batch_loss
from rlkube.core.backends.megatron_layout import (
    convert_optimizer_state,
    megatron_layout,
    megatron_name,
    tiny_layout,
    tiny_name,
    to_megatron,
)
from rlkube.core.batch import Batch
from rlkube.core.losses import LossConfig, LossStats
from rlkube.core.model import TinyConfig, build_model, build_tokenizer

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Transformer Engine / Apex not installed: the local spec is used
    warnings.simplefilter("ignore", DeprecationWarning)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_gpt_model(cfg: TinyConfig, dtype: torch.dtype = torch.float32) -> GPTModel:
    """A megatron-core GPTModel computing the same function as TinyLM(cfg) (see megatron_layout)."""
    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.heads,
        ffn_hidden_size=4 * cfg.hidden_size,
        hidden_dropout=0.0,  # TinyLM has no dropout; the sampling log-probs are dropout-free too
        attention_dropout=0.0,
        layernorm_epsilon=1e-5,  # torch.nn.LayerNorm's
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=torch.nn.functional.gelu,  # exact (erf) GELU, like nn.GELU()
        normalization="LayerNorm",
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # overwritten by the job's initial weights
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cuda_graph_scope=[],  # megatron's default ("full") only triggers a deprecation warning
    )
    with warnings.catch_warnings():
        # megatron 0.16's own deprecations while building from the local spec (tp_group None, ffn_hidden_size)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "Apex is not installed", UserWarning)
        return GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_sequence_length,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False,
            parallel_output=False,
        )


class MegatronBackend:
    def __init__(self, spec: TrainingJobSpec, device: str = "cpu"):
        algo = spec.algorithm
        self.device = torch.device(device)
        megatron_cpu.initialize(spec.model.seed, self.device)
        tokenizer = build_tokenizer(spec.model)
        self.pad_id = tokenizer.pad_id
        initial = build_model(spec.model, tokenizer.vocab_size)  # the weights every inference server starts from
        self.config: TinyConfig = initial.config
        self.heads = self.config.heads
        self.max_sequence_length = self.config.max_sequence_length
        # .to(dtype) as megatron's Float16Module does: some modules (the torch LayerNorm of the local spec) are
        # created in float32 whatever params_dtype says.
        dtype = _DTYPES[spec.model.dtype]
        self.model = build_gpt_model(self.config, dtype).to(device=self.device, dtype=dtype)
        # TinyLM's parameter order: the order of the checkpoint's optimizer state and of published weights.
        self.tiny_names = list(initial.state_dict().keys())
        self.names = [name for name, _ in self.model.named_parameters()]
        if sorted(tiny_name(n) for n in self.names) != sorted(self.tiny_names):
            raise RuntimeError("megatron GPTModel parameters do not correspond to TinyLM's one to one: "
                               f"{sorted(self.names)}")
        self._load_weights(initial.state_dict())
        del initial
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=algo.learning_rate)
        self.loss_config = LossConfig(algo.loss, algo.clip_epsilon_low, algo.clip_epsilon_high)
        self.temperature = algo.temperature
        self.grad_clip_norm = algo.grad_clip_norm

    # --- the Trainer API's backend half ---

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] float32, like TinyLM.forward."""
        t = tokens.shape[1]
        if t > self.max_sequence_length:
            raise ValueError(f"sequence of {t} tokens exceeds maxSequenceLength {self.max_sequence_length}")
        tokens = tokens.to(self.device)
        positions = torch.arange(t, device=self.device)[None].expand_as(tokens)
        out = self.model(tokens, positions, megatron_cpu.causal_mask(t, self.device))
        return out.float()

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        out = batch_loss(self.logits(batch.tokens), batch, self.loss_config, self.temperature, normalizer)
        out.loss.backward()
        return out.stats

    def optim_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # AFTER the step: gradients accumulate until here
        return float(grad_norm)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """TinyLM-named, TinyLM-layout tensors in TinyLM's order: what the native inference server loads."""
        params = dict(self.model.named_parameters())
        by_tiny = {tiny_name(n): tiny_layout(n, p.detach(), self.heads) for n, p in params.items()}
        return [(name, by_tiny[name]) for name in self.tiny_names]

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        model_state = dict(self.weights())
        optim_state = convert_optimizer_state(
            self.optimizer.state_dict(), self.names, self.tiny_names, tiny_name,
            lambda name, t: tiny_layout(name, t, self.heads),
        )
        return model_state, optim_state

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        self._load_weights(model_state)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(convert_optimizer_state(
                optimizer_state, self.tiny_names, self.names, megatron_name,
                lambda name, t: megatron_layout(name, t, self.heads),
            ))

    def _load_weights(self, tiny_state: dict[str, torch.Tensor]) -> None:
        missing = set(self.tiny_names) - set(tiny_state)
        unexpected = set(tiny_state) - set(self.tiny_names)
        if missing or unexpected:
            raise KeyError(f"weights do not match the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in tiny_state.items():
                target, value = to_megatron(name, tensor, self.heads)
                if params[target].shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} != the model's {tuple(params[target].shape)}")
                params[target].copy_(value)
