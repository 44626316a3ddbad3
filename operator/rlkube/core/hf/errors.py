"""The one error type for a model that cannot be used, with the spec field it comes from.

A role that gets a `ModelError` at start exits with its message (the launcher turns it into the termination
message and the job's Failed condition), instead of restarting forever on input that will never work.
"""

from __future__ import annotations


class ModelError(ValueError):
    """`spec.model.*` names something that cannot be loaded; `field` is the spec path, str(err) starts with it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
