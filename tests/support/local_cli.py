"""`rlkube local` as the tests run it: the command line as a child process, and the JSON summary it prints as its
last line with --json (rlkube.local.terminal), which every test of a whole local job reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def local_env(**extra: str) -> dict[str, str]:
    """This process's environment with one torch thread per role (2 cores run several roles at once)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def start_local(*args: str | Path, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`python -m rlkube.cli local ARGS` started, its stdout and stderr piped as text."""
    return subprocess.Popen([sys.executable, "-m", "rlkube.cli", "local", *map(str, args)],
                            env=local_env() if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def summary_of(stdout: str) -> dict:
    """The JSON object a --json command prints as its last line."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_local(manifest: str | Path, out: Path, *args: str | Path, timeout: float = 600, expect: int = 0,
              env: dict[str, str] | None = None) -> tuple[dict, str]:
    """`rlkube local MANIFEST --json --output-dir OUT ARGS` to its end: it must exit `expect` (the message shows
    the tail of its stderr); its summary and its stderr."""
    proc = start_local(manifest, "--json", "--output-dir", out, *args, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"rlkube local ran over {timeout:g}s:\n{stderr[-3000:]}") from None
    assert proc.returncode == expect, f"exit {proc.returncode}, not {expect}:\n{stderr[-3000:]}"
    return summary_of(stdout), stderr



def step_metrics(out: Path) -> list[dict]:
    """The trainer's per-step metrics events of a run's metrics.jsonl (`rlkube local --output-dir out`)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("type") == "metrics"]
