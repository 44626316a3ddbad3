"""examples/tiny-cpu.yaml for the tests: read once, handed out as fresh copies, changed by dotted paths.

- `document(**overrides)`: the whole TrainingJob manifest; paths from the top: {"spec.algorithm.maxSteps": 20}.
- `spec(**overrides)`: its `spec`; paths under spec: {"trainer.nodes": 2}.
- `with_overrides(doc, overrides)`: sets each dotted path in `doc` to a copy of its value (missing or non-mapping
  parents become {}), or removes it where the value is `DELETE` (nothing to remove: nothing changes); returns `doc`.
Dotted keys are not Python names, so callers pass them as `spec(**{"trainer.nodes": 2})`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from rlkube.api.role import Role
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from support import ROOT

POD_ORDER = tuple(r for r in TEARDOWN_ORDER if r != Role.SANDBOX)
"""The roles a job has pods of, in teardown order, when it runs the model's code in process (spec.sandbox.mode
`process`, the default): its status still lists the sandbox stage, which has no pods and passes at once."""

EXAMPLE_PATH = ROOT / "examples" / "tiny-cpu.yaml"
_EXAMPLE = yaml.safe_load(EXAMPLE_PATH.read_text())

class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE = _Delete()
"""An override value that removes the key instead of setting it."""


def with_overrides(doc: dict, overrides: Mapping[str, Any]) -> dict:
    for path, value in overrides.items():
        *parents, last = path.split(".")
        node = doc
        for key in parents:
            if not isinstance(node.get(key), dict):
                if value is DELETE:
                    break
                node[key] = {}
            node = node[key]
        else:
            if value is DELETE:
                node.pop(last, None)
            else:
                node[last] = copy.deepcopy(value)
    return doc


def document(**overrides: Any) -> dict:
    return with_overrides(copy.deepcopy(_EXAMPLE), overrides)


def spec(**overrides: Any) -> dict:
    return with_overrides(copy.deepcopy(_EXAMPLE["spec"]), overrides)
