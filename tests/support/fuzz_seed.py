"""Seeds and case counts of the generated-input tests, so every run says how to reproduce it.

Each test draws its seed from RLKUBE_FUZZ_SEED when set (to replay a failure), else at random; how many cases it
runs comes from RLKUBE_FUZZ_CASES (a multiplier, default 1). Both are printed, with the count of cases really
run, past pytest's output capture, so they are in the output of every run, passing or failing.
"""

from __future__ import annotations

import os
import random

SEED_ENV = "RLKUBE_FUZZ_SEED"
SCALE_ENV = "RLKUBE_FUZZ_CASES"


def seed() -> int:
    given = os.environ.get(SEED_ENV)
    return int(given) if given else random.SystemRandom().randrange(2**32)


def scaled(n: int) -> int:
    return max(1, round(n * float(os.environ.get(SCALE_ENV) or 1)))


def say(capsys, line: str) -> None:
    """Print past pytest's output capture (`capsys` is the test's fixture): seen in passing runs too."""
    with capsys.disabled():
        print(f"\n[generated input] {line}", flush=True)
