"""Tiny randomly initialised Hugging Face models built on the spot for tests (nothing is downloaded): Llama, Qwen2
and Qwen3 configs with grouped-query attention (and tied embeddings where those families use them), with either
the built-in character tokenizer or a byte-level BPE tokenizer trained here on arithmetic text, with a Qwen-style
chat template. Also what tests feed them: a Hugging Face hub-cache layout (for hf:// offline) and JSONL prompt
datasets (arithmetic for the math-verify reward, "repeat the digit" for exact match)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import torch
from rlkube.api.spec import ModelSpec
from rlkube.core.hf.builtin import char_tokenizer
from rlkube.core.hf.source import materialize_model

ARCHITECTURES = ("llama", "qwen2", "qwen3")
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer (Qwen-like specials, no BOS) trained on arithmetic prompts and answers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 60, 3) for b in range(0, 40, 7)]
    corpus += [f"Repeat the digit {d}: {str(d) * 3}" for d in range(10)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN_CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, eos_token_id: int, pad_token_id: int):
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common, head_dim=32, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])
    raise ValueError(arch)


def write_tiny_model(directory: Path, arch: str, tokenizer: str = "char", seed: int = 0,
                     pad_vocab_to: int = 16, **overrides) -> Path:
    """A random `arch` model + tokenizer saved as a HF directory; the embedding has a few rows more than the
    tokenizer has tokens (rounded up to `pad_vocab_to`), as real checkpoints often do. `overrides`: config fields
    (e.g. num_key_value_heads=2)."""
    from transformers import AutoModelForCausalLM

    tok = char_tokenizer() if tokenizer == "char" else bpe_tokenizer()
    rows = -(-len(tok) // pad_vocab_to) * pad_vocab_to
    config = tiny_config(arch, rows, tok.eos_token_id, tok.pad_token_id)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory


def builtin_dir(seed: int = 0) -> Path:
    """builtin://tiny-llama of `seed`, in the default model cache (where the roles of a test find it too)."""
    return materialize_model(ModelSpec(path="builtin://tiny-llama", seed=seed))


def initial_model(spec: ModelSpec, weights: dict[str, torch.Tensor] | None = None):
    """The job's model as every role loads it at start (float32), with `weights` (HF names) loaded when given."""
    from rlkube.core.hf import state as hf_state
    from rlkube.core.hf.loading import load_model

    model = load_model(materialize_model(spec))
    if weights is not None:
        hf_state.load_weights(model, weights)
    return model


def hub_cache(cache: Path, repo: str, model_dir: Path, revision: str = "main") -> str:
    """huggingface_hub's cache layout for `repo` at `revision` under `cache/hub` (where materialize_model looks):
    blobs by hash, snapshots/<commit>/ of symlinks to them, refs/<revision> naming the commit (what
    snapshot_download leaves behind). Returns the commit."""
    commit = hashlib.sha1(repo.encode() + revision.encode()).hexdigest()
    root = Path(cache) / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        blob = root / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return commit


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic_rows(n: int = 64, seed: int = 0) -> list[dict]:
    """{"question": "What is 3+4?", "answer": "7"}: prompts for the math-verify reward."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        rows.append({"question": f"What is {a}+{b}?", "answer": str(a + b)})
    return rows


def repeat_digit_rows(digits: str = "0123") -> list[dict]:
    """{"prompt": "Repeat the digit 3.", "answer": "3"}: learnable from scratch under exact match (one token)."""
    return [{"prompt": f"Repeat the digit {d}.", "answer": d} for d in digits]
