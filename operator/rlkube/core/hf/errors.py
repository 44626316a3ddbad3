"""The one error type for a model that cannot be used, with the spec field it comes from.

A `ConfigError` (rlkube.core.errors): a role that gets one at start exits with its message as the termination
message and runtime.EXIT_CONFIG, and the job fails naming the field instead of restarting a process that can never
start. Also a ValueError, for callers that treat it as bad input in general.
"""

from __future__ import annotations

from rlkube.core.errors import ConfigError


class ModelError(ConfigError, ValueError):
    """`spec.model.*` names something that cannot be loaded; `field` is the spec path, str(err) starts with it."""
