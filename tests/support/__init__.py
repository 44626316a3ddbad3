"""The tests' helpers, one package: spec builders (`specs`), waiting for a condition (`waiting`), the role
processes and the operator as the tests start them (`core_roles`, `operator_harness`), `rlkube local` runs
(`local_cli`), both e2e nodes' job handles (`realnode`, `clusterjob`), and the stand-ins and peer processes the
weight and Fast-LLM tests run (each cites what it follows). tests/conftest.py puts tests/ on sys.path, so a test
imports `from support.specs import spec`; a script here run as its own process puts it there itself.
docs/development/tests.md says which tier holds what."""

from pathlib import Path

DIR = Path(__file__).resolve().parent
"""tests/support: the scripts the tests run as processes live here."""
TESTS = DIR.parent
ROOT = TESTS.parent
