"""The megatron tier's guard (not a test): its tests FAIL, never skip, without megatron-core, because `make test`
installs the `megatron` extra and a missing package there is a bug to see. Deselect with `-m 'not megatron'`."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def megatron_core():
    try:
        # the backend module imports megatron-core with its import-time warnings filtered
        import rlkube.core.backends.megatron_backend  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"megatron tier: megatron-core is not installed ({exc}); pip install -e '.[megatron]' "
                    "(make test does) or deselect with -m 'not megatron'")
