"""No two test modules share a file name.

The test folders have no __init__.py, so pytest imports each module under its bare name: a second module of the
same name anywhere in tests/ is refused at collection ('import file mismatch') and fails the whole run, though
each module passes when run on its own.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        if ".venv" not in path.parts:
            by_name[path.name].append(str(path.relative_to(TESTS)))
    assert not {n: p for n, p in by_name.items() if len(p) > 1}
