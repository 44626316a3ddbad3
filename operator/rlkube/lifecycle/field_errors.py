"""The error a TrainingJob's validation reports: a field path and what is wrong with it.

Its own module so that each group of checks (rlkube.lifecycle.pod_checks, rlkube.lifecycle.validation) builds the
same errors without importing the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """A TrainingJob that cannot run; `errors` name each offending field."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))
