"""Whether an image string is a reference a kubelet can pull, checked before any child of the job exists.

Why: the API server only refuses an image with leading or trailing whitespace; `actor.image: "my image:latest"` is
stored, the job's Redis and trainer pods are created, and only the actor's pod then sits in InvalidImageName while
the job waits. The kubelet parses images with the container-image reference grammar of distribution/reference
(docs/references.md §9); checking the same grammar at validation time refuses the job naming the field, with
nothing created, and `rlkube validate` refuses it too.

Pure; the grammar is composed from its named parts so it reads like the one it follows.
"""

from __future__ import annotations

import re

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = f"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN_AND_PORT = rf"{_HOST}(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN_AND_PORT}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
REFERENCE = re.compile(rf"^({_NAME})(?::({_TAG}))?(?:@({_DIGEST}))?$", re.ASCII)
NAME_MAX = 255
"""Most characters of the repository name (the part before the tag and digest)."""


PUBLISHED = "ghcr.io/rlkube/"
"""Where the project publishes its images: the CRD's default `spec.image`, the chart and the examples name them."""


def relocate(image: str, registry: str | None) -> str:
    """`image` as pulled from `registry` (`host[:port]/prefix`, the chart's `imageRegistry`) when it is one of the
    project's published images, else `image` unchanged: a cluster that cannot reach ghcr.io gets the images a user
    pushed (`make push REGISTRY=...`) with one setting, while an image of the user's own is used as written."""
    if registry and image.startswith(PUBLISHED):
        return f"{registry.rstrip('/')}/{image[len(PUBLISHED):]}"
    return image


def reference_error(image: str) -> str | None:
    """Why `image` is not a pullable image reference, or None."""
    if image != image.strip():
        return f"{image!r} must not have leading or trailing whitespace"
    m = REFERENCE.match(image)
    if m is None:
        hint = ""
        if any(c.isspace() for c in image):
            hint = ": it contains whitespace"
        elif image.lower() != image and REFERENCE.match(image.lower()):
            hint = ": the repository name must be lower case"
        return (f"{image!r} is not an image reference (registry/repository[:tag][@digest], e.g. "
                f"ghcr.io/rlkube/core:0.1.0){hint}")
    if len(m.group(1)) > NAME_MAX:
        return f"{image[:80]!r}... has a repository name of {len(m.group(1))} characters, at most {NAME_MAX}"
    return None
