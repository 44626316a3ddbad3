"""A megatron-core GPTModel loaded from a Hugging Face model directory, exporting Hugging Face names back.

Why: the megatron backend trains megatron-core's GPTModel while every other part of rlkube (the job's model,
checkpoints, weight updates to inference) speaks Hugging Face directories and parameter names. `MegatronGPT` is the
model half of that backend: it builds the GPTModel of a transformers config (`megatron_hf` holds the translation),
loads the directory's safetensors into it, computes logits, and exports weights (or any per-parameter tensors,
such as float32 master weights or gradients) under Hugging Face names. With tensor parallelism each rank's GPTModel
holds its shards; loading takes this rank's shards of the full tensors (`megatron_hf.shard`) and exporting gathers
every rank's over the tensor-parallel group (`gather`, a collective), so both ends keep speaking whole Hugging Face
tensors. Pipeline parallel size 1.

The loss does not take `logits` (full [B, T, V], gathered over the tensor-parallel ranks): `token_logprobs` runs the
GPTModel up to its final hidden states and applies the output layer chunk by chunk of tokens
(rlkube.core.training.losses.chunked_token_logprobs), and with tensor parallelism VOCABULARY-PARALLEL: each rank keeps
the logits of its vocabulary shard and the log-softmax's maximum and sums are all-reduced over the tensor-parallel group
(a SUM whose backward is the identity, megatron's reduce_from_tensor_model_parallel_region), so no rank holds more
than chunk x V/TP logits.

It uses megatron's TE-less local layer spec (`get_gpt_layer_local_spec`), which runs on CPU (through the shim in
`megatron_cpu`) and on a GPU, with every fusion that needs CUDA kernels switched off.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rlkube.core.training import checkpoint as ckpt
from rlkube.core.backends import megatron_cpu
from rlkube.core.backends.megatron_hf import (
    Architecture,
    gpt_model_kwargs,
    hf_state_to_megatron,
    megatron_state_to_hf,
    shard,
    tp_dim,
    transformer_config_kwargs,
    unshard,
)
from rlkube.core.hf.loading import load_config
from rlkube.core.training.losses import DEFAULT_LOSS_CHUNK_TOKENS, VocabParallel, chunked_token_logprobs

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # Transformer Engine / Apex not installed: the local spec is used
    warnings.simplefilter("ignore", DeprecationWarning)
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig


def build_gpt_model(hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                    recompute: bool = False) -> GPTModel:
    """An uninitialised GPTModel with the architecture of `hf_config` (weights are loaded after). `recompute`:
    activation recomputation of every transformer layer in the backward pass (gradient checkpointing)."""
    device = torch.device(device)
    recompute_kwargs = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
                        if recompute else {})
    config = TransformerConfig(
        **recompute_kwargs,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **transformer_config_kwargs(hf_config),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is overwritten by the checkpoint's
        # the fused kernels these switches select need CUDA (and some Apex / Transformer Engine)
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cuda_graph_scope=[],  # megatron's default ("full") only triggers a deprecation warning
    )
    arch = Architecture.of(hf_config)
    with warnings.catch_warnings():
        # megatron 0.16's own deprecations while building from the local spec (tp_group None, ffn_hidden_size)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "Apex is not installed", UserWarning)
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm"),
            **gpt_model_kwargs(hf_config),
        )
    # .to(dtype) as megatron's Float16Module does: the torch norms of the local spec are created in float32
    return megatron_cpu.adapt_model(model.to(device=device, dtype=dtype), device)


def _float32_head(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pre-hook of the output layer of a low-precision model: the LM head multiplies in float32 (the logits that
    form the importance ratio are as exact as the sampler's), like the torch backend's. The weight (its own, or
    the shared embedding GPTModel passes for tied embeddings) is cast inside autograd, so its gradient flows back
    to the low-precision parameter."""
    (hidden, *rest) = args
    weight = kwargs.get("weight")
    kwargs["weight"] = (module.weight if weight is None else weight).float()
    return (hidden.float(), *rest), kwargs


class MegatronGPT:
    """A GPTModel with a Hugging Face model's architecture and weights (see the module docstring)."""

    def __init__(self, hf_config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 seed: int = 0, recompute: bool = False, tensor_parallel: int = 1, timeout_s: float = 1800.0):
        self.device = torch.device(device)
        megatron_cpu.initialize(seed, self.device, tensor_parallel, timeout_s)
        self.tp_size = tensor_parallel
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.hf_config = hf_config
        self.arch = Architecture.of(hf_config)
        self.dtype = dtype
        self.model = build_gpt_model(hf_config, dtype, self.device, recompute)
        if dtype != torch.float32:
            self.model.output_layer.register_forward_pre_hook(_float32_head, with_kwargs=True)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.max_sequence_length = int(hf_config.max_position_embeddings)

    @classmethod
    def from_hf_dir(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", seed: int = 0, recompute: bool = False) -> MegatronGPT:
        # load_config checks the directory; it raises ModelError naming the field
        gpt = cls(load_config(Path(path)), dtype, device, seed, recompute)
        gpt.load_hf_dir(path)
        return gpt

    # --- weights in ---

    def load_hf_dir(self, path: str | Path) -> None:
        """Load the safetensors weights of a model directory of this architecture."""
        self.load_hf_state_dict(ckpt.load_weights(Path(path)))

    def load_hf_state_dict(self, hf_state: Mapping[str, torch.Tensor]) -> None:
        """Load Hugging Face-named weights (strict; converted to the model's dtype)."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in self.to_megatron_names(hf_state).items():
                if params[name].shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} != the model's {tuple(params[name].shape)}")
                params[name].copy_(value)

    # --- Hugging Face names out ---

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names, as the model directory's safetensors hold them (a tied embedding
        once), detached: fused parameters are split into new tensors, the others are the parameters' own storage
        (copy before changing them). A collective with tensor parallelism."""
        return self.to_hf_names({n: self.gather(n, p.detach()) for n, p in self.model.named_parameters()})

    def to_hf_names(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-parameter FULL tensors (tensor-parallel layout 1, see `gather`) keyed by megatron name (weights,
        master weights, gradients) -> Hugging Face names, in megatron's parameter order."""
        return megatron_state_to_hf(self.arch, tensors)

    def to_megatron_names(self, hf_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face-named full tensors -> this rank's tensor of each megatron parameter (its shard with tensor
        parallelism; strict: a missing or unexpected name raises)."""
        full = hf_state_to_megatron(self.arch, hf_state, self.names)
        return {n: self.shard(n, t) for n, t in full.items()}

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This tensor-parallel rank's part of the full tensor of megatron parameter `name` (or of its Adam state)."""
        return shard(name, full, self.tp_rank, self.tp_size)

    def gather(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """COLLECTIVE over the tensor-parallel group (every rank of it, in the same order): the full tensor of
        megatron parameter `name` from every rank's `local` part; `local` itself without tensor parallelism or for
        a replicated parameter."""
        if self.tp_size == 1 or tp_dim(name) is None:
            return local
        parts = [torch.empty_like(local) for _ in range(self.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp_group)
        return unshard(name, parts)

    # --- compute ---

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.max_sequence_length:
            raise ValueError(f"sequence of {t} tokens exceeds max_position_embeddings {self.max_sequence_length}")
        tokens = tokens.to(self.device)
        positions = torch.arange(t, device=self.device)[None].expand_as(tokens)
        return self.model(tokens, positions, megatron_cpu.causal_mask(t, self.device))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (right-padded: causal attention never looks at the padding) -> logits [B, T, V] float32."""
        return self._forward(tokens).float()

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's final hidden states (after the final norm) [B, T, H]: GPTModel's forward returns them
        instead of logits when `post_process` is off (the decoder keeps its own final norm)."""
        self.model.post_process = False
        try:
            return self._forward(tokens).transpose(0, 1)  # megatron's [T, B, H]
        finally:
            self.model.post_process = True

    def head(self, hidden: torch.Tensor, gather: bool) -> torch.Tensor:
        """The output layer on hidden [N, H] -> float32 logits [N, V] (`gather`), or this rank's vocabulary shard
        [N, V / TP]; the tied embedding passed as GPTModel passes it."""
        weight = self.model.shared_embedding_or_output_weight() if self.arch.tied else None
        logits, _ = self.model.output_layer(hidden[:, None], weight=weight, runtime_gather_output=gather)
        return logits[:, 0].float()

    def token_logprobs(self, tokens: torch.Tensor, temperature: float = 1.0,
                       chunk_size: int = DEFAULT_LOSS_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs of tokens[:, 1:] at `temperature`, entropy) [B, T-1] float32, as losses.token_logprobs and
        token_entropy of `logits`, chunked over the tokens and vocabulary-parallel (module docstring)."""
        vocab = None
        if self.tp_size > 1:
            group = self.tp_group

            def max_(t: torch.Tensor) -> None:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

            shard = self.hf_config.vocab_size // self.tp_size  # check_tensor_parallel: TP divides the vocabulary
            vocab = VocabParallel(self.tp_rank * shard, max_,
                                  lambda t: reduce_from_tensor_model_parallel_region(t, group=group))
        return chunked_token_logprobs(self.hidden_states(tokens), lambda h: self.head(h, gather=vocab is None),
                                      tokens.to(self.device), temperature, chunk_size, vocab)

