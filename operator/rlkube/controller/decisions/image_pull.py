"""Pods whose image the kubelet cannot pull: after how long that fails the job, and what the failure says.

Why: a pod whose image cannot be pulled never runs, so it never exits and never counts against a restart budget;
the kubelet retries the pull forever (ImagePullBackOff), and the job would sit in Pending or Running with a
component not ready and nobody told why. A pull that stays impossible for
`spec.runPolicy.imagePullTimeoutSeconds` fails the job with reason ImagePullFailed, naming the image field that set
the image and quoting the kubelet's message; a reason that no retry can cure (an image name the kubelet cannot
parse, or imagePullPolicy Never with the image absent from the node) fails it at once. A pull that succeeds on a
retry before the deadline is no failure.

The waiting reasons are the kubelet's (kubernetes pkg/kubelet/images/types.go:27-44, ErrImagePullBackOff to
ErrInvalidImageName). The clock starts when the operator first saw the pod's pull fail, kept per pod UID in
status.components[role].pullFailingSince (so an operator restart does not reset it), and stops when the pod leaves
the failure: a large image whose pull fails once after minutes of progress gets the whole timeout again. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from rlkube.api.spec import TrainingJobSpec
from rlkube.controller.decisions.observed import PodView

RETRIED = frozenset({"ErrImagePull", "ImagePullBackOff", "RegistryUnavailable", "ImageInspectError"})
"""The kubelet keeps retrying these (a registry outage or a tag pushed late can still resolve)."""
PERMANENT = frozenset({"InvalidImageName", "ErrImageNeverPull"})
"""No retry can cure these: the reference does not parse, or the policy forbids the pull of an absent image."""


@dataclass(frozen=True)
class Unpullable:
    """A pod that cannot pull its image, and since when (None: fails at once)."""

    pod: PodView
    reason: str  # the kubelet's waiting reason, "Init:" prefixed for an init container
    since: datetime | None

    def message(self, spec: TrainingJobSpec, timeout_s: int) -> str:
        field = spec.image_field(self.pod.role)
        detail = f": {self.pod.waiting_message}" if self.pod.waiting_message else ""
        waited = "" if self.since is None else f" for {timeout_s}s (spec.runPolicy.imagePullTimeoutSeconds)"
        return (f"pod {self.pod.name} cannot pull its image {spec.image_for(self.pod.role)!r} ({field}){waited}: "
                f"{self.reason}{detail}")


def bare_reason(reason: str | None) -> str:
    return (reason or "").removeprefix("Init:")


def unpullable(pods: list[PodView], seen: Mapping[str, datetime], now: datetime) -> list[Unpullable]:
    """The live pods now waiting on an image pull, the permanent ones first; a retried failure is dated from
    `seen` (pod UID -> when it was first seen failing), or from `now` when this pass is the first to see it."""
    out = []
    for pod in pods:
        reason = bare_reason(pod.waiting_reason)
        if pod.deleting or reason not in RETRIED | PERMANENT:
            continue
        since = None if reason in PERMANENT else seen.get(pod.uid, now)
        out.append(Unpullable(pod, pod.waiting_reason, since))
    return sorted(out, key=lambda u: (u.since is not None, u.since or now, u.pod.name))


def overdue(failing: list[Unpullable], timeout_s: int, now: datetime) -> tuple[Unpullable | None, datetime | None]:
    """The first of `failing` that fails the job now, and, while there is none, when to look again (the earliest
    deadline still ahead). `timeout_s` 0: only the permanent reasons fail the job."""
    ahead = []
    for u in failing:
        if u.since is None:
            return u, None
        if timeout_s > 0:
            due = u.since + timedelta(seconds=timeout_s)
            if now >= due:
                return u, None
            ahead.append(due)
    return None, min(ahead, default=None)
