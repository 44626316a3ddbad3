"""Build the CPU images of images/ with buildah, on a Debian base made here (`make images`).

Why this exists: the Dockerfiles' public bases (python:3.11-slim, ...) come from container registries that a
build machine may not reach, and nothing had ever built them. This script makes the base from Debian's packages
with mmdebstrap (bookworm, python3.11, pip), imports it into buildah's storage, and builds each image from the
repository's own Dockerfile through their base-image build arguments, so the same files stay valid for a plain
`docker build`. Each Dockerfile's build-time import check runs as one of its RUN steps.

Cache by content (under $RLKUBE_CACHE, default ~/.cache/rlkube, like the control plane's binaries): an image
whose key (its Dockerfile, the files it copies, its build arguments and its base's key) is unchanged and still
in buildah's storage is skipped. buildah's `--layers` then also reuses unchanged steps of a changed image (the
core image's torch layer comes before the COPY of operator/).

`--check` runs the checks a pod would meet: the operator image has no torch; the core image runs
`python -m rlkube.core.trainer --help` as uid 10001 on a read-only root with a writable /tmp as HOME, as the
operator's pods have; the redis image runs `redis-server --version` so; the vLLM CPU image imports torch and
vllm so and makes vLLM's cache directory (it must follow HOME onto /tmp). It uses runc with its default bundle config,
whose root is read-only (`buildah run` 1.28 has no read-only root).

`--push REGISTRY` (`make push REGISTRY=host[:port]/prefix`) builds nothing: it pushes the named images from buildah's
storage to REGISTRY/<name>:<tag> (the name and tag of their local tag, localhost/rlkube/<name>:<tag>), the layout
the chart's `imageRegistry` value pulls from; `--insecure` for a plain-HTTP registry (buildah --tls-verify=false).

Stdlib only: runs with any python3 >= 3.11 (no project virtual environment needed).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RLKUBE_CACHE", Path.home() / ".cache" / "rlkube")) / "images"
VERSION = "0.1.0"
TORCH_VERSION = "2.13.0"

# The base: Debian bookworm's python3 (3.11) and pip. Debian marks its python "externally managed" (PEP 668),
# which makes `pip install` as root fail; in an image the distro python is the only python, as the official
# python image's is, so the marker goes. python-is-python3: the Dockerfiles call `python`.
BASE_RECIPE = [
    "mmdebstrap", "--variant=minbase", "--include=python3,python3-pip,python-is-python3,ca-certificates",
    "--customize-hook=rm -f \"$1\"/usr/lib/python3*/EXTERNALLY-MANAGED", "bookworm",
]
BASE_CONFIG = ["--env", "LANG=C.UTF-8", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               "--cmd", "python3"]


@dataclass
class Image:
    name: str
    dockerfile: str
    tag: str
    base_arg: str  # the build argument that names the base image
    base: str  # "debian" or the name of another Image
    args: dict[str, str] = field(default_factory=dict)


IMAGES = {
    "operator": Image("operator", "images/operator/Dockerfile", f"localhost/rlkube/operator:{VERSION}",
                      "PYTHON_IMAGE", "debian"),
    "core": Image("core", "images/core/Dockerfile", f"localhost/rlkube/core:{VERSION}", "PYTHON_IMAGE", "debian",
                  {"TORCH_VARIANT": "cpu"}),
    # The managed Redis (spec.redis.image) from Debian's package: no registry serves redis:7-alpine here.
    "redis": Image("redis", "images/redis/Dockerfile", f"localhost/rlkube/redis:{VERSION}", "BASE_IMAGE", "debian"),
    "vllm-cpu": Image("vllm-cpu", "images/vllm/Dockerfile", f"localhost/rlkube/vllm:{VERSION}-cpu", "CORE_IMAGE",
                      "core", {"TORCH_VARIANT": "cpu"}),
}
DEFAULT = ["operator", "core"]


def log(msg: str) -> None:
    print(f"[images] {msg}", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def sha(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()


def image_exists(tag: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", tag], capture_output=True).returncode == 0


def image_size(tag: str) -> str:
    """buildah's own figure (uncompressed, all layers), as `buildah images` prints it."""
    return sh(["buildah", "images", "--format", "{{.Size}}", tag], capture_output=True, text=True).stdout.strip()


def copied_files(dockerfile: Path) -> list[Path]:
    """Every file a Dockerfile's COPY/ADD takes from the context, minus what .dockerignore drops from it."""
    files: list[Path] = []
    lines = dockerfile.read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD") or any(w.startswith("--from") for w in words):
            continue
        for src in [w for w in words[1:-1] if not w.startswith("--")]:
            for match in sorted(glob.glob(str(ROOT / src))):
                p = Path(match)
                files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    # The patterns .dockerignore excludes inside operator/ (byte code, egg-info, wip/).
    return [f for f in files if not ({"__pycache__", "wip"} & set(f.relative_to(ROOT).parts)
                                     or f.suffix == ".pyc" or any(p.endswith(".egg-info") for p in f.parts))]


def content_key(image: Image, base_key: str, args: dict[str, str]) -> str:
    """The hash of what an image is built from: base, build arguments, Dockerfile and the files it copies."""
    df = ROOT / image.dockerfile
    parts: list[bytes | str] = [base_key, json.dumps(args, sort_keys=True), df.read_bytes()]
    for f in copied_files(df):
        parts += [str(f.relative_to(ROOT)), f.read_bytes()]
    return sha(*parts)


def base_image() -> tuple[str, str]:
    """The Debian base's tag and key, built and imported into buildah's storage when not there yet."""
    key = sha(json.dumps(BASE_RECIPE), json.dumps(BASE_CONFIG))
    tag = f"localhost/rlkube/base:bookworm-{key[:12]}"
    if image_exists(tag):
        log(f"base {tag}: cached")
        return tag, key
    CACHE.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        tar = Path(tmp) / "rootfs.tar"
        log(f"base: mmdebstrap bookworm -> {tar}")
        sh([BASE_RECIPE[0], "--quiet", *BASE_RECIPE[1:], str(tar)])
        # `buildah add` unpacks a local tar archive into the working container: the rootfs becomes one layer.
        ctr = sh(["buildah", "from", "scratch"], capture_output=True, text=True).stdout.strip()
        try:
            sh(["buildah", "add", "--quiet", ctr, str(tar), "/"], stdout=subprocess.DEVNULL)
            sh(["buildah", "config", *BASE_CONFIG, ctr])
            sh(["buildah", "commit", "--quiet", ctr, tag], stdout=subprocess.DEVNULL)
        finally:
            subprocess.run(["buildah", "rm", ctr], capture_output=True)
    log(f"base {tag}: built in {time.monotonic() - start:.0f} s, {image_size(tag)}")
    return tag, key


def local_torch_wheels() -> str | None:
    """A directory holding the CPU torch wheel, where pip's configuration points at one (find-links)."""
    cfg = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    dirs = [os.environ.get("PIP_FIND_LINKS", "")]
    dirs += [line.split("=", 1)[1].strip("'\"") for line in cfg.splitlines()
             if line.split("=")[0].endswith("find-links")]
    for d in (x for entry in dirs for x in entry.split() if x):
        d = d.removeprefix("file://")
        if glob.glob(os.path.join(d, f"torch-{TORCH_VERSION}+cpu-cp311-*.whl")):
            return d
    return None


def build(image: Image, base_tag: str, base_key: str, force: bool) -> tuple[str, str]:
    """Builds one image unless its content key is unchanged; returns (key, "built"/"cached")."""
    args = {**image.args, image.base_arg: base_tag}
    run_args: list[str] = []
    if image.args.get("TORCH_VARIANT") == "cpu" and (wheels := local_torch_wheels()):
        # download.pytorch.org may be unreachable (it is on the machine this was written on); the CPU wheel
        # on disk is mounted for the build's RUN steps only and found through --find-links.
        args["TORCH_INDEX"] = "--find-links /wheels"
        run_args += ["--volume", f"{wheels}:/wheels:ro"]
    key = content_key(image, base_key, args)
    stamp = CACHE / f"{image.name}.key"
    if not force and stamp.is_file() and stamp.read_text() == key and image_exists(image.tag):
        return key, "cached"
    cmd = ["buildah", "bud", "--layers", "--network", "host", "-f", image.dockerfile, "-t", image.tag]
    # crun (buildah's default here) refuses cgroups v1+v2 hybrid hosts; runc runs there.
    if runc := shutil.which("runc"):
        cmd += ["--runtime", runc]
    # The RUN steps' pip must trust the host's TLS roots (an intercepting egress proxy adds one): mounted during
    # RUN only, so nothing of the build host ends up in the image.
    if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
        run_args += ["--volume", "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"]
    for k, v in args.items():
        cmd += ["--build-arg", f"{k}={v}"]
    log(f"{image.name}: buildah bud -f {image.dockerfile} -t {image.tag}")
    before = image_id(image.tag)
    sh([*cmd, *run_args, "."], cwd=ROOT)
    stamp.write_text(key)
    if before and before != image_id(image.tag):
        # The image the tag named before is now untagged: every rebuild would otherwise leave gigabytes behind,
        # and a node whose disk fills up garbage-collects the images the tests just imported. A failure (still
        # used by another tag or a container) leaves it where it is.
        subprocess.run(["buildah", "rmi", before], capture_output=True)
    return key, "built"


def image_id(tag: str) -> str | None:
    out = subprocess.run(["buildah", "images", "--quiet", "--no-trunc", tag], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None


def run_ro(tag: str, argv: list[str], user: str = "10001:10001") -> subprocess.CompletedProcess:
    """Runs argv in the image with runc as `user` on a read-only root (runc spec's default), as a pod would."""
    cfg = json.loads(sh(["buildah", "inspect", "--type", "image", tag], capture_output=True, text=True).stdout)
    ctr = sh(["buildah", "from", "--quiet", tag], capture_output=True, text=True).stdout.strip()
    try:
        rootfs = sh(["buildah", "mount", ctr], capture_output=True, text=True).stdout.strip()
        with tempfile.TemporaryDirectory() as bundle:
            sh(["runc", "spec", "--bundle", bundle])
            spec = json.loads(Path(bundle, "config.json").read_text())
            uid, gid = (int(x) for x in user.split(":"))
            spec["root"] = {"path": rootfs, "readonly": True}
            spec["process"].update(terminal=False, args=argv, user={"uid": uid, "gid": gid},
                                   env=[*cfg["OCIv1"]["config"].get("Env", []), "HOME=/tmp"],
                                   cwd=cfg["OCIv1"]["config"].get("WorkingDir") or "/")
            # As the operator's pods have it (controller/manifests/builders.py): /tmp is a writable volume and HOME.
            # Without it `import torch` fails on a read-only root ("No usable temporary directory found").
            spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                                   "options": ["nosuid", "nodev", "mode=1777"]})
            # The machine's network namespace (no CNI here); the pod network is the cluster's business.
            spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"]
            Path(bundle, "config.json").write_text(json.dumps(spec))
            return subprocess.run(["runc", "run", "--bundle", bundle, f"rlkube-check-{os.getpid()}"],
                                  capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True)


def check(names: list[str]) -> bool:
    ok = True
    if "operator" in names:
        r = run_ro(IMAGES["operator"].tag, ["python", "-c", "import torch"])
        passed = r.returncode != 0 and "No module named 'torch'" in r.stderr
        log(f"check operator: `python -c 'import torch'` exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"
            f" -> {'ok (no torch)' if passed else 'FAIL'}")
        ok &= passed
    if "core" in names:
        r = run_ro(IMAGES["core"].tag, ["sh", "-c", "id -u; touch /probe 2>&1; python -m rlkube.core.trainer --help"])
        lines = r.stdout.splitlines()
        passed = (r.returncode == 0 and lines[:1] == ["10001"] and "Read-only file system" in r.stdout
                  and "usage:" in r.stdout)
        log(f"check core (uid 10001, read-only root): exit {r.returncode}; " + " | ".join(lines[:3])
            + f" -> {'ok' if passed else 'FAIL ' + r.stderr[-2000:]}")
        ok &= passed
    if "redis" in names:
        r = run_ro(IMAGES["redis"].tag, ["redis-server", "--version"])
        passed = r.returncode == 0 and r.stdout.startswith("Redis server v=")
        log(f"check redis (uid 10001, read-only root): exit {r.returncode}; {r.stdout.strip()[:40]}"
            f" -> {'ok' if passed else 'FAIL ' + r.stderr[-2000:]}")
        ok &= passed
    if "vllm-cpu" in names:
        # vLLM's cache directory made as the engine makes it: on the read-only root it must follow HOME (/tmp).
        probe = ("import os, torch, vllm, vllm.envs as e; os.makedirs(e.VLLM_CACHE_ROOT, exist_ok=True); "
                 "print(torch.__version__, vllm.__version__, e.VLLM_CACHE_ROOT)")
        r = run_ro(IMAGES["vllm-cpu"].tag, ["python", "-c", probe])
        passed = r.returncode == 0
        log(f"check vllm-cpu (uid 10001, read-only root): exit {r.returncode}; torch, vLLM, cache = {r.stdout.strip()}"
            f" -> {'ok' if passed else 'FAIL ' + r.stderr[-2000:]}")
        ok &= passed
    return ok


def push_target(image: Image, registry: str) -> str:
    """Where `--push` puts an image: REGISTRY/<name>:<tag> of its local tag localhost/rlkube/<name>:<tag>."""
    return f"{registry.rstrip('/')}/{image.tag.rsplit('/', 1)[-1]}"


def push(names: list[str], registry: str, insecure: bool, digests: Path | None = None) -> int:
    missing = [IMAGES[n].tag for n in names if not image_exists(IMAGES[n].tag)]
    if missing:
        log(f"not built: {', '.join(missing)} (run `make images IMAGES=\"{' '.join(names)}\"` first)")
        return 1
    for name in names:
        image, start = IMAGES[name], time.monotonic()
        dest = push_target(image, registry)
        with tempfile.TemporaryDirectory() as tmp:
            digest_file = Path(tmp) / "digest"
            sh(["buildah", "push", "--quiet", f"--tls-verify={'false' if insecure else 'true'}", "--digestfile",
                str(digest_file), image.tag, f"docker://{dest}"], stdout=subprocess.DEVNULL)
            digest = digest_file.read_text().strip()
        log(f"pushed {image.tag} -> {dest} ({digest}) in {time.monotonic() - start:.0f} s")
        if digests is not None:  # `repository@digest` lines: what a signer signs (.github/workflows/release.yml)
            with digests.open("a") as fh:
                fh.write(f"{dest.rsplit(':', 1)[0]}@{digest}\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", nargs="*", default=DEFAULT, help=f"of {list(IMAGES)} (default: {DEFAULT})")
    ap.add_argument("--force", action="store_true", help="rebuild even when the content key is unchanged")
    ap.add_argument("--check", action="store_true", help="run the operator/core checks after building")
    ap.add_argument("--push", metavar="REGISTRY", default=None,
                    help="push the built images to REGISTRY/<name>:<tag> instead of building (host[:port]/prefix)")
    ap.add_argument("--insecure", action="store_true", help="with --push: a plain-HTTP registry (no TLS)")
    ap.add_argument("--digests", type=Path, default=None, help="with --push: append `repository@digest` lines here")
    opts = ap.parse_args()
    if opts.push:
        if unknown := set(opts.images) - set(IMAGES):
            ap.error(f"unknown images {sorted(unknown)}")
        return push([n for n in IMAGES if n in opts.images], opts.push, opts.insecure, opts.digests)
    for tool in ("buildah", "mmdebstrap"):
        if not shutil.which(tool):
            log(f"{tool} is missing: apt-get install -y buildah mmdebstrap runc")
            return 2
    names = [n for n in IMAGES if n in opts.images or any(IMAGES[m].base == n for m in opts.images if m in IMAGES)]
    if unknown := set(opts.images) - set(IMAGES):
        ap.error(f"unknown images {sorted(unknown)}")
    base_tag, base_key = base_image()
    keys = {"debian": base_key}
    tags = {"debian": base_tag}
    rows = []
    for name in names:
        image = IMAGES[name]
        start = time.monotonic()
        keys[name], how = build(image, tags[image.base], keys[image.base], opts.force)
        tags[name] = image.tag
        rows.append((image.tag, how, time.monotonic() - start, image_size(image.tag)))
    for tag, how, secs, size in rows:
        log(f"{tag:36} {how:6} {secs:6.0f} s  {size:>8}")
    return 0 if not opts.check or check(names) else 1


if __name__ == "__main__":
    sys.exit(main())
