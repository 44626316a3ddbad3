"""spec.tracking: the experiment trackers the trainer logs to (rlkube.core.tracking), and the Secret references
that carry their credentials without putting them in the spec."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlkube.api.base import Model

SECRET_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A Secret's name: a lowercase RFC 1123 subdomain (at most 253 characters), what the API server demands of the
secretKeyRef the operator builds from it. (spec.redis.passwordSecret is checked by the operator instead: a managed
Redis ignores it, lifecycle.validation.pod_field_errors.)"""
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"
"""A key inside a Secret, as the API server demands of a secretKeyRef's key."""


class MlflowTrackingSpec(Model):
    """An MLflow tracking server (rlkube.core.tracking.mlflow_sink): one run per job, named after it."""

    tracking_uri: str = Field(
        ..., min_length=1, max_length=2048, pattern=r"^(https?|file)://[^/@?#]*([/?#].*)?$",
        description="The tracking server's URI, as seen from the trainer pod (http(s)://host:port, or file:// for "
        "a directory the trainer writes); no user:password@ (the spec is no place for credentials: set "
        "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD from a Secret in spec.trainer.template's env).",
    )
    experiment_name: str = Field(
        "rlkube", min_length=1, max_length=500,
        description="Experiment the job's run is logged under (created when missing).",
    )


class ApiKeySecretRef(Model):
    """A key of a Secret in the job's namespace: the operator passes it to the trainer pod as an environment
    variable (secretKeyRef); its value never appears in the spec, the status, Events, logs or the job's ConfigMap."""

    name: str = Field(..., min_length=1, max_length=253, pattern=SECRET_NAME,
                      description="Secret name (in the job's namespace).")
    key: str = Field(..., min_length=1, max_length=253, pattern=SECRET_KEY,
                     description="Key inside the Secret holding the API key.")


class WandbTrackingSpec(Model):
    """Weights & Biases (rlkube.core.tracking.wandb_sink): one run per job, named after it."""

    project: str = Field(..., min_length=1, max_length=128, description="W&B project of the job's run.")
    entity: str | None = Field(None, min_length=1, max_length=128, description="W&B entity (user or team); "
                               "unset: the key's default entity.")
    mode: Literal["online", "offline"] = Field(
        "online", description="`online`: sent to the W&B server as the run goes; `offline`: written to "
        "`tracking/wandb` under the trainer's checkpoint path only (upload later with `wandb sync`).",
    )
    api_key_secret: ApiKeySecretRef | None = Field(
        None, description="The Secret key holding the W&B API key (required online, unless baseUrl's server needs "
        "none); the trainer gets it as WANDB_API_KEY.",
    )
    base_url: str | None = Field(None, min_length=1, max_length=2048, pattern=r"^https?://[^/@?#]*([/?#].*)?$",
                                 description="A self-hosted W&B server (unset: W&B's cloud); no user:password@.")


class TensorBoardTrackingSpec(Model):
    """TensorBoard event files written by the trainer (rlkube.core.tracking.tensorboard_sink)."""

    directory: str = Field(
        "tensorboard", min_length=1, max_length=255,
        pattern=r"^[A-Za-z0-9_][-A-Za-z0-9._]*(/[A-Za-z0-9_][-A-Za-z0-9._]*)*$",
        description="Directory, relative to `tracking/` under the trainer's checkpoint path (its volume: "
        "spec.trainer.checkpoint.claimName), that the event files go to; point TensorBoard's --logdir at it.",
    )


class TrackingSpec(Model):
    """Experiment trackers the trainer sends its metrics (every step), the evaluation results and the job's config
    to (rlkube.core.tracking). A tracker that fails never fails or slows the job: it is reported once (condition
    TrackerFailed and an Event) and the others go on."""

    mlflow: MlflowTrackingSpec | None = Field(None, description="Log to an MLflow tracking server.")
    wandb: WandbTrackingSpec | None = Field(None, description="Log to Weights & Biases.")
    tensorboard: TensorBoardTrackingSpec | None = Field(
        None, description="Write TensorBoard event files to the trainer's checkpoint volume (`{}`: the defaults).")

    @property
    def any(self) -> bool:
        return any(t is not None for t in (self.mlflow, self.wandb, self.tensorboard))
