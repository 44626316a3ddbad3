"""`python -m rlkube.core.actor`: the actor role, reported as every role is (rlkube.core.errors.run_role)."""

import sys

from rlkube.core.actor import role
from rlkube.core.errors import run_role


def main() -> int:
    return role.main()


if __name__ == "__main__":
    sys.exit(run_role(main))
