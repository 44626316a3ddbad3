"""What a reconcile pass asks the API server (and Redis) to do: plain values returned by the decisions.

The decisions never perform I/O; the reconcile loop applies these in order. Every action is idempotent
(create: 409 = present; delete: 404 = gone, uid precondition so a replacement pod is never hit), so a pass
interrupted at any point (an operator killed mid-way) is simply redone by the next one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Create:
    manifest: dict[str, Any]
    mint: str | None = None
    """A Secret's `stringData` key the applier fills with a fresh random value as it creates the object (the
    managed Redis password): a secret is minted only when it is actually created, and the decisions stay pure."""

    def minted(self, value: str) -> dict[str, Any]:
        """The manifest to create, with `value` under the `mint` key (the manifest as it is when nothing is minted)."""
        if self.mint is None:
            return self.manifest
        return {**self.manifest, "stringData": {**self.manifest.get("stringData", {}), self.mint: value}}

    @property
    def kind(self) -> str:
        return self.manifest["kind"]

    @property
    def name(self) -> str:
        return self.manifest["metadata"]["name"]


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    grace_seconds: int
    role: str
    force: bool = False
    """A force deletion (grace 0 after the stage's grace period ran out), counted in metrics."""


@dataclass(frozen=True)
class DeleteObject:
    kind: str  # ConfigMap | Secret | Service | NetworkPolicy
    name: str


@dataclass(frozen=True)
class DeleteStreams:
    """Delete the job's keys in an external Redis (a managed Redis takes them with its pod)."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class DeleteJob:
    """ttlSecondsAfterFinished ran out: delete the TrainingJob itself."""


@dataclass(frozen=True)
class PatchWorkloadStatus:
    """Merge-patch a Kueue Workload's status, guarded by the resourceVersion the decision saw (a 409 means
    Kueue wrote first: the next pass decides again on what it wrote)."""

    name: str
    resource_version: str
    status: dict[str, Any]


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the TrainingJob."""

    type: str  # Normal | Warning
    reason: str
    message: str


Action = Create | DeletePod | DeleteObject | DeleteStreams | DeleteJob | PatchWorkloadStatus
