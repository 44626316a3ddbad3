"""`python -m rlkube.core.trainer`: the trainer role process (rlkube.core.trainer.role)."""

import sys

from rlkube.core.errors import run_role
from rlkube.core.trainer import role


def main() -> int:
    return role.main()


if __name__ == "__main__":
    sys.exit(run_role(main))
