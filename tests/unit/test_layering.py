"""The package's floors, checked from the source: what the operator may import, and what nothing may import.

- rlkube.bench (benchmarks, the fake kubelet) is the top floor: no other rlkube module imports it.
- No shipped module finds files relative to itself up into the repository (`parents[N]`) or reaches into the
  repository's tests/: an installed wheel has neither (tests/integration/test_install.py runs one).
- The operator's modules and `rlkube bench operator` import nothing of the training stack (torch, numpy, ...):
  the base install, which is all the operator image has, does not carry it (pyproject.toml, the `core` extra).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "rlkube"
TRAINING_STACK = ("torch", "numpy", "safetensors", "matplotlib", "rich", "psutil", "transformers", "datasets",
                  "math_verify")


def _modules() -> dict[str, ast.Module]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_nothing_outside_bench_imports_bench():
    modules = _modules()
    assert "rlkube.bench.simulate" in modules and "rlkube.bench.operator" in modules
    offenders = {
        name: sorted(i for i in _imports(tree) if i == "rlkube.bench" or i.startswith("rlkube.bench."))
        for name, tree in modules.items()
        if not name.startswith("rlkube.bench")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_check_above_sees_an_import_of_bench():
    tree = ast.parse("def f():\n    from rlkube.bench.simulate import FakeKubelet\n")
    assert "rlkube.bench.simulate" in _imports(tree)


def test_no_shipped_module_reaches_into_the_repository():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        assert ".parents[" not in text, f"{rel} finds files through parents[N]"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith(("tests/", "examples/")), f"{rel} names {node.value!r}"
        assert "sys.path.insert" not in text, f"{rel} edits sys.path"


def test_the_operator_and_the_operator_bench_import_no_training_stack():
    # In a fresh interpreter (this one may have torch loaded already): import what the operator image runs and
    # what `rlkube bench operator` runs, build every CLI parser, and list what of the training stack got loaded.
    code = (
        "import sys, rlkube.cli, rlkube.controller.main, rlkube.controller.handlers, rlkube.controller.loop, "
        "rlkube.bench.operator\n"
        "rlkube.cli.build_parser().parse_args(['bench', 'operator', '--jobs', '2', '--kubeconfig', 'k'])\n"
        f"print(sorted(m for m in {TRAINING_STACK!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.strip() == "[]", out.stdout
