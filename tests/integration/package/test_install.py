"""The package as a user installs it: this repository's wheel in fresh virtual environments, run from elsewhere.

SLOW (marker `install`): each environment is created with `python -m venv` (no system site-packages) and
pip-installs the wheel's dependencies from the package index, as a user's machine would. Measured on the
2-core development machine under load: base install (kopf, kubernetes-asyncio, redis, ...) about 75 s; the
`core` extra (torch 2.13.0 from the CPU wheel on disk, then transformers, datasets, matplotlib, ...) about
5 minutes with a cold pip cache. One environment of each kind per session.

- without extras: `rlkube operator` starts with no torch installed, and `rlkube bench operator --kubeconfig K`
  runs against the session's API server from a directory outside the repository (no tests/, no examples/);
- with `[core]`: `rlkube local tiny-cpu.yaml` trains the tiny job to the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.local_cli import summary_of
from cluster.control_plane import binaries
from support import ROOT

pytestmark = [pytest.mark.install, pytest.mark.timeout(1800)]

BENCH_KEYS = {"n", "create_to_children_p50", "create_to_children_p99", "finished_to_released_p50",
              "finished_to_released_p99", "operator_rss_mb", "job_controller_create_p50", "job_controller_create_p99",
              "create_ratio_p50", "create_ratio_p99", "teardown_ratio_p99", "load_1m", "api_requests"}


def _clean_env() -> dict[str, str]:
    """This environment without what would make the venv's Python import this checkout or another venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1", "PIP_NO_INPUT": "1"}


@dataclass
class Venv:
    path: Path

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")

    def bin(self, name: str) -> str:
        return str(self.path / "bin" / name)

    def run(self, argv: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)


def _make_venv(path: Path, *installs: list[str]) -> Venv:
    """`python -m venv` (no --system-site-packages), then each `pip install` in turn; prints how long each took."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, env=_clean_env(), timeout=300)
    venv = Venv(path)
    timings = [f"venv {time.monotonic() - t0:.0f}s"]
    for args in installs:
        t0 = time.monotonic()
        # --no-compile: pip would byte-compile every module it installs (torch alone: ~10 CPU-s of ~15 here); the
        # interpreter compiles the ones the tests import when they first import them, as it would without pip.
        out = venv.run([venv.python, "-m", "pip", "install", "-q", "--no-compile", *args], cwd=path, timeout=1500)
        assert out.returncode == 0, f"pip install {args}:\n{out.stderr[-5000:]}"
        timings.append(f"pip install {' '.join(args)}: {time.monotonic() - t0:.0f}s")
    print(f"{path.name}: " + "; ".join(timings), file=sys.stderr)
    return venv


@pytest.fixture(scope="session")
def base_venv(tmp_path_factory, wheel) -> Venv:
    return _make_venv(tmp_path_factory.mktemp("venvs") / "base", [str(wheel)])


@pytest.fixture(scope="session")
def core_venv(tmp_path_factory, wheel) -> Venv:
    # torch alone first: the extra's torch==2.13.0 is then satisfied by the CPU wheel (any other build is CUDA).
    return _make_venv(tmp_path_factory.mktemp("venvs") / "core", ["torch==2.13.0"], [f"{wheel}[core]"])


@pytest.fixture
def away(tmp_path) -> Path:
    """A working directory outside the repository, holding only a copy of the tiny example."""
    shutil.copy(ROOT / "examples" / "tiny-cpu.yaml", tmp_path / "tiny-cpu.yaml")
    assert not (tmp_path / "tests").exists() and ROOT not in tmp_path.parents
    return tmp_path


def _imported_from(venv: Venv, cwd: Path) -> Path:
    out = venv.run([venv.python, "-c", "import rlkube; print(rlkube.__file__)"], cwd)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def test_the_base_install_runs_the_operator_without_torch(base_venv, away):
    cfg = (base_venv.path / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    assert base_venv.path in _imported_from(base_venv, away).parents  # the wheel, not this checkout

    out = base_venv.run([base_venv.bin("rlkube"), "operator", "--help"], away)
    assert out.returncode == 0 and "--all-namespaces" in out.stdout, out.stderr
    # --help only parses arguments: import what the operator runs too, and check nothing pulled torch in.
    code = ("import sys, rlkube.controller.process.main, rlkube.controller.process.handlers, rlkube.bench.operator\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    out = base_venv.run([base_venv.python, "-c", code], away)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    for module in ("torch", "numpy"):
        out = base_venv.run([base_venv.python, "-c", f"import {module}"], away)
        assert out.returncode != 0 and f"No module named '{module}'" in out.stderr, (module, out.stderr)

    out = base_venv.run([base_venv.bin("rlkube"), "validate", "tiny-cpu.yaml"], away)
    assert out.returncode == 0 and "tiny-cpu: valid" in out.stdout, out.stderr


def test_bench_operator_runs_from_the_wheel(base_venv, away, cluster, crd):
    # The bench starts `python -m rlkube.cli operator` with the venv's interpreter: the operator under test is
    # the base install's too.
    out = base_venv.run([base_venv.bin("rlkube"), "bench", "operator", "--kubeconfig", str(cluster), "--jobs", "2",
                         "--json", "--kube-controller-manager", binaries(build=False)["kcm"]], away, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = summary_of(out.stdout)
    assert set(result) == BENCH_KEYS and result["n"] == 2
    assert 0 < result["create_to_children_p50"] <= result["create_to_children_p99"]
    assert 0 < result["finished_to_released_p50"] <= result["finished_to_released_p99"]
    assert 30 < result["operator_rss_mb"] < 2000
    # What each run cost the API server: ours creates 4 pods per job, the Job controller as many; the CPU figures
    # come from this machine's /proc (the session's control plane runs here).
    ours, theirs = result["api_requests"]["ours"], result["api_requests"]["job_controller"]
    assert ours["writes_by_kind_per_job"]["POST pods"] == theirs["writes_by_kind_per_job"]["POST pods"] == 4
    assert ours["cpu_ms_per_job"]["operator"] > 0 and ours["cpu_ms_per_job"]["kube-apiserver"] > 0


def test_the_core_install_runs_rlkube_local(core_venv, away):
    assert core_venv.path in _imported_from(core_venv, away).parents
    out = core_venv.run([core_venv.bin("rlkube"), "local", "tiny-cpu.yaml", "--json", "--output-dir", "run"], away,
                        timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = summary_of(out.stdout)
    assert summary["phase"] == "Succeeded" and summary["steps"] == summary["max_steps"] == 40, summary
    assert summary["teardown"] == ["actor", "preprocessor", "inference", "trainer", "redis"]
    assert (away / "run" / "reward.png").is_file()
