"""The TrainingJob API: typed spec and status, their CRD, and validation beyond the schema."""

from rlkube.api.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TrainingJobSpec,
)
from rlkube.api.status import ConditionType, Phase, TrainingJobStatus
from rlkube.api.validation import FieldError, SpecError, parse_manifest, parse_spec, semantic_errors

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "ConditionType", "Phase",
    "TrainingJobSpec", "TrainingJobStatus", "FieldError", "SpecError", "parse_manifest", "parse_spec",
    "semantic_errors",
]
