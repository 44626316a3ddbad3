"""The shared training core: one package, one role per process (trainer, actor, preprocessor, inference)."""
