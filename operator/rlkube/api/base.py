"""The base of every TrainingJob type: one pydantic model configuration (camelCase on the wire, unknown fields
refused) and the few shapes the spec, the status and the pod template share, in a module below all of them so none
imports another for its base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

Quantity = int | str


class Model(BaseModel):
    """Base for every spec type: camelCase on the wire, snake_case in Python, unknown fields rejected."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


PRESERVE = {"x-kubernetes-preserve-unknown-fields": True}
"""Marks a Kubernetes type too big to model here (affinity terms, volume sources): the CRD keeps it as written and
the API server checks it when the operator creates the pod."""
