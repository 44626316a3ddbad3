"""`python -m rlkube.core.inference`: the inference role, reported as every role is (rlkube.core.errors.run_role)."""

import sys

from rlkube.core.errors import run_role
from rlkube.core.inference import shell


def main() -> int:
    return shell.main()


if __name__ == "__main__":
    sys.exit(run_role(main))
