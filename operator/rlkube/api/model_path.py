"""The three forms of `spec.model.path`, parsed without I/O (the operator validates with it, every role resolves it).

- a directory (`/models/qwen`, a PVC or image path; relative paths are relative to the role's working directory)
- `hf://org/name[@revision]`: a Hugging Face Hub repository, fetched once into the model cache
- `builtin://<name>`: a model rlkube writes itself from the spec's seed (`builtin://tiny-llama`)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

BUILTIN_SCHEME = "builtin://"
HF_SCHEME = "hf://"
BUILTIN_MODELS = ("tiny-llama",)
BUILTIN_ATTENTION_HEADS = {"tiny-llama": (2, 2)}
"""(attention heads, key/value heads) of each built-in model (rlkube.core.hf.builtin writes them): what a
tensor-parallel size must fit, checked before any pod starts."""
# Hub repository ids: `org/name` of letters, digits, `-`, `_`, `.`; a revision is a branch, tag or commit.
_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class ModelPath:
    kind: Literal["dir", "hf", "builtin"]
    location: str  # the directory, the repo id, or the built-in name
    revision: str | None = None


def parse_model_path(path: str, field: str = "spec.model.path") -> ModelPath:
    """Parse `spec.model.path`; ValueError (naming `field`) when it is malformed."""
    if path.startswith(BUILTIN_SCHEME):
        name = path[len(BUILTIN_SCHEME):]
        if name not in BUILTIN_MODELS:
            known = ", ".join(BUILTIN_SCHEME + n for n in BUILTIN_MODELS)
            raise ValueError(f"{field}: unknown built-in model {path!r} (known: {known})")
        return ModelPath("builtin", name)
    if path.startswith(HF_SCHEME):
        m = _HF.match(path)
        if m is None:
            raise ValueError(f"{field}: {path!r} is not hf://org/name or hf://org/name@revision")
        return ModelPath("hf", m.group("repo"), m.group("revision"))
    if "://" in path:
        raise ValueError(f"{field}: unknown scheme in {path!r} (a directory, hf://org/name[@revision], "
                         "or builtin://tiny-llama)")
    return ModelPath("dir", path)
