"""The release workflow (.github/workflows/release.yml) is valid and does what a release needs, though it cannot run
here: no forge runner, no ghcr.io credentials.

check-jsonschema validates it against GitHub's workflow schema (SchemaStore's, vendored in the wheel: offline),
which refuses unknown keys, a malformed trigger or step, a wrong permission name. The rest is what the workflow must
do, read from the parsed file: run on a version tag only; hold the permissions to push packages and to sign keylessly
(id-token); build with the builder `make images` runs and push with `make push`'s (images/build.py), every image
the chart and the examples name; sign each pushed digest with cosign.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def _lint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("check-jsonschema", path=str(Path(sys.executable).parent)) or shutil.which("check-jsonschema")
    assert exe, "check-jsonschema is missing: it is in the `dev` extra (pyproject.toml)"
    return subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(path)], capture_output=True,
                          text=True, timeout=120)


def test_the_release_workflow_passes_github_s_workflow_schema():
    out = _lint(WORKFLOW)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_linter_refuses_a_broken_workflow(tmp_path):
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["jobs"]["images"]["runs-on"] = {"bogus": True}
    doc["permissions"]["id-tokens"] = "write"
    bad = tmp_path / "release.yml"
    bad.write_text(yaml.safe_dump(doc))
    out = _lint(bad)
    assert out.returncode != 0 and "id-tokens" in out.stdout + out.stderr, out.stdout


def test_the_release_workflow_builds_pushes_and_signs_on_a_tag():
    doc = yaml.safe_load(WORKFLOW.read_text())
    on = doc[True] if True in doc else doc["on"]  # YAML 1.1 reads the key `on` as true
    assert set(on) == {"push"} and set(on["push"]) == {"tags"} and on["push"]["tags"] == ["v*"]
    assert doc["permissions"] == {"contents": "write", "packages": "write", "id-token": "write"}
    steps = doc["jobs"]["images"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    uses = [s.get("uses", "") for s in steps]
    images = doc["jobs"]["images"]["env"]["IMAGES"].split()
    assert {"operator", "core", "redis"} <= set(images)
    assert "images/build.py --check ${IMAGES}" in runs  # what `make images` runs
    assert 'images/build.py --push "${REGISTRY}" --digests digests.txt ${IMAGES}' in runs  # what `make push` runs
    assert 'REGISTRY=ghcr.io/' in runs
    assert any(u.startswith("sigstore/cosign-installer@") for u in uses)
    sign = next(s for s in steps if "cosign sign" in s.get("run", ""))
    assert "digests.txt" in sign["run"] and steps.index(sign) > next(
        i for i, s in enumerate(steps) if "--push" in s.get("run", ""))
