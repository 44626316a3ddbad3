"""`python -m rlkube.core.preprocessor`: the preprocessor role, reported as every role is
(rlkube.core.errors.run_role)."""

import sys

from rlkube.core.errors import run_role
from rlkube.core.preprocessor import role


def main() -> int:
    return role.main()


if __name__ == "__main__":
    sys.exit(run_role(main))
