"""The TrainingJob API: typed spec and status and their CRD. Types only.

It imports nothing else of rlkube (tests/unit/test_layering.py), so every floor above can use it; the checks
beyond the schema are rlkube.lifecycle.validation.
"""

from rlkube.api.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TrainingJobSpec,
)
from rlkube.api.status import ConditionType, Phase, TrainingJobStatus

__all__ = [
    "API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "ConditionType", "Phase", "TrainingJobSpec",
    "TrainingJobStatus",
]
