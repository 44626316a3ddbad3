"""The documentation site as a reader gets it: `make docs` builds it strictly, every link and image in it resolves,
and headless Chromium loads every page without a console error or a failed request.

The build is the Makefile's own target (`make docs SITE_DIR=...`, mkdocs --strict: a broken link or anchor between
pages fails it), run inside `make test` by this module. The crawl reads every built HTML file and resolves each
`href`/`src` that stays inside the site, down to the `id` a fragment names, and refuses any page resource (a
script, a stylesheet, an image) loaded from another host: the site must render with no network. Chromium (Debian's
`chromium`, the Makefile's APT_PACKAGES) then loads each page from a local HTTP server that records every request;
a request answered 404, or a line Chromium logs from the page's console, fails the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from support import ROOT

pytestmark = pytest.mark.integration

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync")
RESOURCE_TAGS = {("script", "src"), ("link", "href"), ("img", "src"), ("source", "src"), ("iframe", "src")}


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[str, str, str]] = []  # (tag, attribute, value)
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if value and (tag, name) in RESOURCE_TAGS | {("a", "href")}:
                self.refs.append((tag, name, value))


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    t0 = time.monotonic()
    proc = subprocess.run(["make", "-s", "docs", f"SITE_DIR={out}", f"PYTHON={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"make docs (mkdocs build --strict) failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    print(f"make docs: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def test_the_site_has_its_sections(site):
    for page in ("index.html", "reference/trainingjob.html", "reference/pod-template.html", "reference/cli.html",
                 "troubleshooting.html", "design.html", "references.html", "getting-started/images.html"):
        assert (site / page).is_file(), f"{page} missing from the built site"
    reference = (site / "reference/trainingjob.html").read_text()
    assert 'id="spec.trainer.lora.rank"' in reference and 'id="status.phase"' in reference
    guides = sorted(p.name for p in (ROOT / "docs" / "guide").glob("*.md")) if (ROOT / "docs" / "guide").is_dir() else []
    for name in guides:
        assert (site / "guide" / name.replace(".md", ".html")).is_file(), f"docs/guide/{name} not in the site"
        assert f'guide/{name.replace(".md", ".html")}' in (site / "index.html").read_text(), \
            f"docs/guide/{name} not in the navigation"


def test_every_link_and_image_resolves(site):
    problems = []
    ids: dict[Path, set[str]] = {}
    for page in _pages(site):
        parsed = _parse(page)
        for tag, attr, value in parsed.refs:
            split = urlsplit(value)
            if split.scheme in ("http", "https") or value.startswith("//"):
                if (tag, attr) in RESOURCE_TAGS and not (tag == "link" and "canonical" in value):
                    problems.append(f"{page.relative_to(site)}: <{tag} {attr}={value!r}> loads from another host")
                continue
            if split.scheme in ("mailto", "data", "javascript"):
                continue
            target = page if not split.path else (page.parent / unquote(split.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                problems.append(f"{page.relative_to(site)}: <{tag} {attr}={value!r}>: {target} does not exist")
                continue
            if split.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = _parse(target).ids
                if unquote(split.fragment) not in ids[target]:
                    problems.append(f"{page.relative_to(site)}: {value!r}: no id {split.fragment!r} in "
                                    f"{target.relative_to(site)}")
    assert not problems, "\n".join(problems)


class _Recorder(SimpleHTTPRequestHandler):
    requests: list[tuple[str, int]]

    def log_request(self, code="-", size="-"):
        self.requests.append((self.path, int(code) if str(code).isdigit() else 0))

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def _serve(site: Path) -> tuple[ThreadingHTTPServer, list[tuple[str, int]]]:
    requests: list[tuple[str, int]] = []
    handler = type("Handler", (_Recorder,), {"requests": requests})
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, requests


def chromium(url: str, profile: str, *extra: str) -> subprocess.CompletedProcess:
    """Chromium, headless and offline, loading one URL; its console lines go to stderr (--enable-logging)."""
    return subprocess.run(
        ["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *extra, url],
        capture_output=True, text=True, timeout=120,
    )


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.fixture(scope="module")
def browser():
    if shutil.which("chromium") is None:
        pytest.fail("chromium is not installed: `make deps-apt` installs it (the Makefile's APT_PACKAGES)")
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        yield profile


def test_chromium_sees_a_broken_page(tmp_path, browser):
    """The check below can fail: a console error and a missing image are both seen."""
    (tmp_path / "bad.html").write_text('<h1>x</h1><img src="missing.png"><script>console.error("boom")</script>')
    server, requests = _serve(tmp_path)
    try:
        out = chromium(f"http://127.0.0.1:{server.server_port}/bad.html", browser, "--dump-dom")
    finally:
        server.shutdown()
    assert any('"boom"' in line for line in console_lines(out.stderr)), out.stderr[-3000:]
    assert ("/missing.png", 404) in requests


def test_every_page_renders_in_chromium(site, browser):
    server, requests = _serve(site)
    pages = _pages(site)
    problems = []
    t0 = time.monotonic()
    try:
        for page in pages:
            rel = page.relative_to(site).as_posix()
            before = len(requests)
            out = chromium(f"http://127.0.0.1:{server.server_port}/{rel}", browser, "--dump-dom")
            if out.returncode != 0:
                problems.append(f"{rel}: chromium exited {out.returncode}: {out.stderr[-2000:]}")
                continue
            if "md-content" not in out.stdout or "<h1" not in out.stdout:
                problems.append(f"{rel}: the rendered page has no content (no article heading)")
            problems += [f"{rel}: console: {line}" for line in console_lines(out.stderr)]
            problems += [f"{rel}: GET {path} -> {code}" for path, code in requests[before:] if code >= 400]
    finally:
        server.shutdown()
    print(f"chromium: {len(pages)} pages in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    assert not problems, "\n".join(problems)
