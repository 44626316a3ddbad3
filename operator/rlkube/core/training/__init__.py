"""The training stack the trainer (rlkube.core.trainer) and every backend (rlkube.core.backends) share, below
both: checkpoints, LoRA adapters, batches and losses. Kept free of imports, so a module that needs one part does
not load the others (docs/design.md, the module map)."""
