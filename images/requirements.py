"""Print rlkube's pip requirements from pyproject.toml, for images that install the package with `--no-deps`.

Why: two images already carry a torch build that must stay (the Fast-LLM image: NVIDIA's PyTorch container)
or need none (the operator image: the operator never imports torch, and a CUDA or CPU torch would add
hundreds of MB). They install the requirements this prints, then `pip install --no-deps` the package, so the
list can never drift from pyproject.toml.

    python images/requirements.py [--without PKG ...] [--extra NAME ...] [PYPROJECT]
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(req: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not match:
        raise ValueError(f"not a requirement: {req!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, without: list[str] = (), extras: list[str] = ()) -> list[str]:
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extra(s) {unknown}; pyproject.toml has {sorted(optional)}")
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += optional[extra]
    drop = {requirement_name(w) for w in without}
    return [r for r in reqs if requirement_name(r) not in drop]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", nargs="?", default="pyproject.toml", type=Path)
    parser.add_argument("--without", action="append", default=[], help="leave this distribution out")
    parser.add_argument("--extra", action="append", default=[], help="add this extra's requirements")
    args = parser.parse_args(argv)
    sys.stdout.write("".join(r + "\n" for r in requirements(args.pyproject, args.without, args.extra)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
