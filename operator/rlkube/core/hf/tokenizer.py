"""What the roles ask of a Hugging Face tokenizer, in one small wrapper.

Prompts given as text are encoded the way vLLM's completions endpoint does (`add_special_tokens=True`: a Llama
tokenizer prepends its BOS, a Qwen tokenizer adds nothing), so the native engine and vLLM see the same ids.
Generation ends on any end-of-sequence id: the tokenizer's eos plus those of generation_config.json (an instruct
model often has several, e.g. Qwen's <|im_end|> and <|endoftext|>).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlkube.core.hf.errors import ModelError

FIELD = "spec.model.path"


class Tokenizer:
    def __init__(self, hf: Any, eos_ids: tuple[int, ...] = ()):
        self.hf = hf
        ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_ids = tuple(dict.fromkeys([*ids, *eos_ids]))  # the tokenizer's own first, no duplicates
        # No pad token (Llama 3): eos pads. Padding is never attended to nor trained on, so any id would do.
        pad = hf.pad_token_id
        self.pad_id = int(pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0))
        self.bos_id = hf.bos_token_id
        self.unk_id = hf.unk_token_id

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        from transformers import AutoTokenizer

        directory = Path(directory)
        try:
            hf = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
            raise ModelError(FIELD, f"cannot load the tokenizer of {directory}: {type(exc).__name__}: {exc}") from None
        return cls(hf, generation_eos_ids(directory))

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer can produce (base vocabulary plus added tokens)."""
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        """A completions prompt's ids, special tokens added as the tokenizer's post-processor says (like vLLM)."""
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text (the `tokens` of a completion's logprobs), special tokens included."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The rendered conversation. It already holds any BOS the template writes, so tokenize it with
        special tokens off (send its ids, not its text, to a completions endpoint)."""
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def generation_eos_ids(directory: Path) -> tuple[int, ...]:
    """eos_token_id of generation_config.json (an int or a list), () when absent or unreadable."""
    path = Path(directory) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(e for e in eos if isinstance(e, int))
    return ()
