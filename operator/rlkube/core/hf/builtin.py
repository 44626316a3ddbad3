"""`builtin://tiny-llama`: the demo model, a tiny randomly initialised Hugging Face Llama with a character-level
tokenizer, written to disk from the spec's seed (nothing is downloaded; every role writes the same bytes).

Shape: 2 layers, hidden 64, 2 attention heads of 32 (head_dim >= 32 so that vLLM can serve it too), SwiGLU MLP of
256, untied embeddings, RoPE: the smallest Llama that learns the demo tasks (reverse-digits in 40 steps) as fast as
the private model it replaced. The weights are drawn explicitly (normal(0, 0.02) for matrices and embeddings, ones
for RMSNorm) with a torch.Generator seeded from `seed`, in state_dict order, so they depend on the seed and the
shape only, not on transformers' own initialisation.

The tokenizer (tokenizers' WordLevel over single characters + PreTrainedTokenizerFast) has <pad> <bos> <eos> <unk>
and the characters of CHARSET; like a Llama tokenizer it prepends <bos> to every encoded text. Its chat template
concatenates the messages' contents after <bos>, so a chat prompt of the digit tasks tokenizes exactly like the
plain prompt.
"""

from __future__ import annotations

from pathlib import Path

from rlkube.api.model_path import BUILTIN_ATTENTION_HEADS

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARSET = "0123456789+-*=:;,.?!()[]<>/ abcdefghijklmnopqrstuvwxyz"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
FORMAT_VERSION = 1  # part of the cache directory's name: bump whenever the bytes written change
MAX_POSITIONS = 2048
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
INIT_STD = 0.02


def char_tokenizer():
    """The character tokenizer as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARSET])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # ...joined back without separators
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False,
                                   model_max_length=MAX_POSITIONS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int):
    from transformers import LlamaConfig

    heads, kv_heads = BUILTIN_ATTENTION_HEADS["tiny-llama"]
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=32, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        initializer_range=INIT_STD, architectures=["LlamaForCausalLM"],
    )


def write_tiny_llama(directory: Path, seed: int) -> None:
    """Write the model, its config, generation config and tokenizer into `directory` (which must exist)."""
    import torch  # here, not at the top: finding the written directory (FORMAT_VERSION) must not import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = char_tokenizer()
    config = tiny_llama_config(len(tokenizer))
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * INIT_STD)
    # Not model.save_pretrained: transformers writes its files on torch.distributed rank 0 only
    # (PreTrainedModel.should_save_on_this_rank), and a trainer rank writes its own copy after it joined its group:
    # rank 1 would write a directory without config.json or weights.
    from safetensors.torch import save_file

    config.dtype = torch.float32  # what save_pretrained records: the weights' dtype
    config.save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(str(directory))


BUILTIN_WRITERS = {"tiny-llama": write_tiny_llama}
