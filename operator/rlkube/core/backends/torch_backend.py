"""The `torch` backend: the job's Hugging Face model (AutoModelForCausalLM) trained with plain torch on CPU or one
GPU (several with data parallelism, see torch_distributed), Adam, gradient clipping, an LR schedule.

Precision: the parameters and Adam's state are float32 (the master weights). With `spec.model.dtype: bfloat16`
the decoder runs under bfloat16 autocast (matmuls in bfloat16), while the LM head and the log-softmax stay in
float32 so the log-probs that form the importance ratio are as exact as the sampler's. Updates are applied to the
float32 masters, so an update below bfloat16's resolution (lr x step << |w| / 256) still accumulates, where a
model trained in pure bfloat16 would round it away every step.

Reference policy (spec.algorithm.klCoef > 0): a frozen copy of the INITIAL model (the job's model directory, also
on resume) for the KL term of rlkube.core.training.losses. Memory: one extra copy of the weights in the compute dtype
(spec.model.dtype: 2 bytes a parameter in bfloat16, 4 in float32; 1 GB for a 0.5B model in bfloat16), no
gradients, no optimizer state; plus one no-grad forward per micro-batch, its log-probs taken chunk by chunk too.

Loss memory: the loss never holds the logits of the whole micro-batch. `token_logprobs` takes the decoder's final
hidden states and applies the LM head (calling the model's output-embedding submodule, so tied embeddings and
FSDP2's unsharded parameters are what the full forward would use) with the log-softmax chunk by chunk under
activation checkpointing (rlkube.core.training.losses.chunked_token_logprobs): O(loss_chunk_tokens x vocabulary) instead
of O(tokens x vocabulary). `logits` (the full [B, T, V]) remains for evaluation.

LoRA (spec.trainer.lora, rlkube.core.training.lora): the model is wrapped by PEFT after loading; only the adapter's
parameters train (Adam holds state for them alone) and the float32 base stays frozen. `state()`/`load_state()` are
then the adapter's tensors under PEFT's names (what checkpoints and the data-parallel start-up sync carry: every
rank loads the same base from the job's directory), `weights()` the merged full weights under the HF names (for
an engine that takes full weights), and `adapter_update()` the adapter alone (the native engine's update). The
reference policy of the KL term is the same model with the adapter disabled (peft's `disable_adapter`): the
initial policy at no memory cost.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from rlkube.api.spec import TrainingJobSpec
from rlkube.core.backends.base import logprob_loss, loss_config, lr_scheduler
from rlkube.core.training import lora as lora_mod
from rlkube.core.training.batch import Batch
from rlkube.core.hf import ModelError
from rlkube.core.hf import state as hf_state
from rlkube.core.hf.loading import DTYPES, check_sequence_length, load_model, load_tokenizer
from rlkube.core.training.losses import DEFAULT_LOSS_CHUNK_TOKENS, LossStats, chunked_token_logprobs
from rlkube.core.weights.wire import AdapterUpdate


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant torch.utils.checkpoint).
    transformers >= 5.x calls it activation checkpointing; earlier releases gradient checkpointing."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hidden_states(model, tokens: torch.Tensor, autocast) -> torch.Tensor:
    """The decoder's final hidden states [B, T, H] of right-padded `tokens` (in the compute dtype)."""
    with autocast():
        return model.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state


def model_logits(model, tokens: torch.Tensor, autocast) -> torch.Tensor:
    """float32 logits [B, T, V] (decoder in the compute dtype, LM head in float32)."""
    return model.get_output_embeddings()(hidden_states(model, tokens, autocast).float())


def model_logprobs(model, tokens: torch.Tensor, autocast, temperature: float,
                   chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of tokens[:, 1:] at `temperature`, entropy), [B, T-1] float32, as `losses.token_logprobs` and
    `token_entropy` of `model_logits` but chunked over the tokens (module docstring)."""
    head = model.get_output_embeddings()
    return chunked_token_logprobs(hidden_states(model, tokens, autocast), lambda h: head(h.float()), tokens,
                                  temperature, chunk_size)


class TorchBackend:
    shards_gradients = False  # (rlkube.core.backends.base.TrainerBackend: declared capabilities)
    collective_weights = False
    parallel_layout = None
    loss_chunk_tokens = DEFAULT_LOSS_CHUNK_TOKENS  # tokens per chunk of the LM head + log-softmax in the loss

    def __init__(self, spec: TrainingJobSpec, model_dir: Path, device: str = "cpu"):
        algo = spec.algorithm
        if spec.model.dtype == "float16":
            # float16 gradients underflow without loss scaling, which this backend does not do.
            raise ModelError("spec.model.dtype", "the torch backend trains in float32 or bfloat16 (float16 needs "
                                                 "loss scaling); use bfloat16")
        self.device = torch.device(device)
        self.model = load_model(model_dir, torch.float32, self.device)  # float32 masters whatever model.dtype says
        tokenizer = load_tokenizer(model_dir, self.model.config)
        check_sequence_length(self.model.config, spec.model.max_sequence_length)
        self.pad_id = tokenizer.pad_id
        self.max_sequence_length = spec.model.max_sequence_length
        self.compute_dtype = DTYPES[spec.model.dtype]
        if spec.trainer.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.model.config.use_cache = False
        self._aliases = hf_state.tied_aliases(self.model)
        self.lora = spec.trainer.lora  # None: full-weight training
        if self.lora is not None:
            self._hf_names = list(hf_state.named_weights(self.model))  # the base's HF names, before PEFT renames
            self.model = lora_mod.wrap(self.model, self.lora, spec.model.seed)  # freezes the base (module docstring)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.gradient_parameters(), lr=algo.learning_rate)
        self.scheduler = lr_scheduler(self.optimizer, algo.lr_schedule, algo.warmup_steps, algo.max_steps)
        self.loss_config = loss_config(algo)
        self.reference = None
        if algo.kl_coef > 0 and self.lora is None:
            # Frozen, in the compute dtype (module docstring); lifecycle.validation refuses klCoef with FSDP.
            self.reference = load_model(model_dir, self.compute_dtype, self.device).requires_grad_(False)
            self.reference.config.use_cache = False
        # The actors' sampling log-probs are of the temperature-scaled distribution; so are ours.
        self.temperature = algo.temperature
        self.grad_clip_norm = algo.grad_clip_norm

    @property
    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, T, V] of right-padded `tokens` (decoder in the compute dtype, LM head in float32)."""
        return model_logits(self.model, tokens, self._autocast)

    def token_logprobs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs of tokens[:, 1:] at the job's temperature with gradient, entropy), [B, T-1], chunked."""
        return model_logprobs(self.model, tokens, self._autocast, self.temperature, self.loss_chunk_tokens)

    def reference_logprobs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The reference policy's log-probs of `tokens` [B, T] -> [B, T-1] (None without a reference)."""
        if self.lora is not None and self.loss_config.kl_coef > 0:
            with torch.no_grad(), self.model.disable_adapter():  # the base: the initial policy
                logprobs, _ = model_logprobs(self.model, tokens, self._autocast, self.temperature,
                                             self.loss_chunk_tokens)
            return logprobs
        if self.reference is None:
            return None
        with torch.no_grad():
            logprobs, _ = model_logprobs(self.reference, tokens, self._autocast, self.temperature,
                                         self.loss_chunk_tokens)
        return logprobs

    def gradient_parameters(self) -> list[torch.nn.Parameter]:
        """The trained parameters (with LoRA: the adapter's only)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def forward_backward(self, batch: Batch, normalizer: float) -> LossStats:
        tokens = batch.tokens.to(self.device)
        ref = self.reference_logprobs(tokens)
        new_logp, entropy = self.token_logprobs(tokens)
        out = logprob_loss(new_logp, entropy, batch, self.loss_config, normalizer, ref_logprobs=ref)
        out.loss.backward()
        return out.stats

    def optim_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.gradient_parameters(), self.grad_clip_norm)
        self.optimizer.step()
        self.scheduler.step()
        # Zero AFTER the step (docs/references.md §6.15: zeroing inside forward_backward broke accumulation).
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The full weights under their HF names (with LoRA: base + adapter merged, rlkube.core.training.lora)."""
        if self.lora is not None:
            return lora_mod.merged_weights(self.model, self._hf_names)
        return list(hf_state.named_weights(self.model).items())

    def adapter_update(self) -> AdapterUpdate:
        """LoRA: the adapter alone, as a weight update (rlkube.core.weights.wire.AdapterUpdate)."""
        if self.lora is None:
            raise RuntimeError("adapter_update() without spec.trainer.lora")
        return AdapterUpdate(list(lora_mod.adapter_state(self.model).items()), lora_mod.wire_config(self.lora))

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(model state: the HF weights, or with LoRA the adapter's tensors under PEFT's names; optimizer)."""
        model_state = (lora_mod.adapter_state(self.model) if self.lora is not None
                       else hf_state.named_weights(self.model))
        return model_state, {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        if self.lora is not None:
            lora_mod.load_adapter_state(self.model, model_state)
        else:
            hf_state.load_weights(self.model, model_state, self._aliases)
        if optimizer_state is not None:
            self.optimizer.load_state_dict(optimizer_state["optimizer"])
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
