"""The trainer: its API (`Trainer`, api.py: forward_backward / optim_step / save_checkpoint / publish_weights) and
its role process (`TrainerRole`, role.py; `python -m rlkube.core.trainer`), which reads the job's training
documents from Redis, trains samplesPerStep of them per step (collect -> train -> publish -> checkpoint), and
reports weights_ready, metrics, checkpoint_saved and training_finished on the job's events stream. The parallel
mode is chosen once per process (parallel.py); publishers.py is weight publication as the trainer sees it.
The names other modules and tests use are importable from here."""

from rlkube.core.trainer.api import Trainer
from rlkube.core.trainer.publishers import AnnounceOnly, Publisher
from rlkube.core.trainer.role import (
    DEFAULT_DOCUMENT_TIMEOUT_S,
    ENV_DOCUMENT_TIMEOUT,
    DocumentTimeout,
    TrainerRole,
    build_role,
    document_timeout_from_env,
    main,
    require_expected_checkpoint,
)

__all__ = [
    "DEFAULT_DOCUMENT_TIMEOUT_S",
    "ENV_DOCUMENT_TIMEOUT",
    "AnnounceOnly",
    "DocumentTimeout",
    "Publisher",
    "Trainer",
    "TrainerRole",
    "build_role",
    "document_timeout_from_env",
    "main",
    "require_expected_checkpoint",
]
