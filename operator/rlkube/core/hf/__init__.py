"""The Hugging Face model directory: THE model format of rlkube (trainer backends, checkpoints, weight transfer,
native inference engine).

- `source.materialize_model(spec.model, cache_dir)`: the ready directory for `spec.model.path` (a directory,
  `hf://org/name[@revision]` fetched with huggingface_hub, or `builtin://tiny-llama` written from the seed).
- `loading`: the supported architectures, config/tokenizer checks, `load_model` (transformers, no remote code).
- `tokenizer.Tokenizer`: the few things the roles ask of a tokenizer (encode a prompt as vLLM does, decode, eos).
- `state`: state dicts under HF names with each tied weight once (checkpoints and the weight transfer).
- `errors.ModelError`: every bad-input error names the spec field (the roles' termination messages).

Submodules import transformers lazily where they can: the actor and the preprocessor should not pay for it.
"""

from rlkube.core.hf.errors import ModelError

__all__ = ["ModelError"]
