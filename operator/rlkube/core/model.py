"""The built-in tiny causal language model and character tokenizer, built locally (nothing is downloaded).

Every role builds the same model from the job spec with the same seed, so the trainer's initial weights and the
inference server's are identical without shipping a file (`builtin://tiny-lm`). A directory path instead holds
`model.safetensors` + `config.json` written by `save_pretrained`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from rlkube.api.spec import ModelSpec

# --- tokenizer ---------------------------------------------------------------------------------------

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARSET = "0123456789+-*=:;,.?!()[]<>/ abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character of a fixed alphabet, plus pad/bos/eos. Unknown characters raise."""

    def __init__(self, charset: str = CHARSET):
        self.vocab = SPECIALS + list(charset)
        self.index = {tok: i for i, tok in enumerate(self.vocab)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        try:
            ids = [self.index[ch] for ch in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer's alphabet") from None
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids if i >= len(SPECIALS))


def build_tokenizer(spec: ModelSpec) -> CharTokenizer:
    if spec.tokenizer == "builtin://char":
        return CharTokenizer()
    path = Path(spec.tokenizer) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"spec.model.tokenizer: {path} not found (or use builtin://char)")
    return CharTokenizer(json.loads(path.read_text())["charset"])


# --- model -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int
    layers: int = 2
    hidden_size: int = 64
    heads: int = 4
    max_sequence_length: int = 64


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden_size)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.ln2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size), nn.GELU(), nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, pre-LN blocks, untied head."""

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.max_sequence_length, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] int64 -> logits [B, T, V] (float32)."""
        t = tokens.shape[1]
        if t > self.config.max_sequence_length:
            raise ValueError(f"sequence of {t} tokens exceeds maxSequenceLength {self.config.max_sequence_length}")
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)).float()

    def save_pretrained(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(asdict(self.config)))


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(spec: ModelSpec, vocab_size: int | None = None) -> TinyLM:
    """The job's initial model: built-in random init (seeded) or loaded from a directory."""
    if spec.path.startswith("builtin://"):
        if spec.path != "builtin://tiny-lm":
            raise ValueError(f"spec.model.path: unknown built-in model {spec.path!r} (known: builtin://tiny-lm)")
        arch = spec.architecture
        cfg = TinyConfig(
            vocab_size=vocab_size or build_tokenizer(spec).vocab_size,
            layers=arch.layers,
            hidden_size=arch.hidden_size,
            heads=arch.heads,
            max_sequence_length=arch.max_sequence_length,
        )
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(spec.seed)
        model = TinyLM(cfg)
        torch.random.set_rng_state(gen_state)
    else:
        directory = Path(spec.path)
        cfg = TinyConfig(**json.loads((directory / "config.json").read_text()))
        model = TinyLM(cfg)
        model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    return model.to(_DTYPES[spec.dtype])


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of tokens[:, 1:] under logits[:, :-1] / temperature -> [B, T-1]."""
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
