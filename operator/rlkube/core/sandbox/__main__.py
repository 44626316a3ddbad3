"""`python -m rlkube.core.sandbox`: the sandbox server role, reported as every role is (rlkube.core.errors.run_role)."""

import sys

from rlkube.core.errors import run_role
from rlkube.core.sandbox import server


def main() -> int:
    return server.main()


if __name__ == "__main__":
    sys.exit(run_role(main))
