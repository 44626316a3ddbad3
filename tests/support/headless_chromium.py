"""Open an HTML file in Debian's headless Chromium and drive it over the Chrome DevTools protocol (a websocket,
websocket-client): load it, collect every console error and uncaught exception, evaluate checks in the page, and take
a full-page screenshot. For `rlkube report` (tests/integration/local/test_samples_and_report.py).

Chromium runs with no network use of its own (no background networking, component updates, sync) and a fresh
profile; `--remote-debugging-port=0` lets it pick a free port, which it writes to DevToolsActivePort in the profile.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websocket

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-default-apps",
         "--mute-audio", "--hide-scrollbars")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageResult:
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, failed loads
    values: dict[str, Any] = field(default_factory=dict)  # each check's value
    screenshot: bytes = b""


class Chromium:
    def __init__(self, width: int = 1400, height: int = 1000):
        self.width, self.height = width, height
        self.profile = Path(tempfile.mkdtemp(prefix="rlkube-chromium-"))
        exe = chromium()
        if exe is None:
            raise RuntimeError("no chromium on PATH (Debian's `chromium` package; make deps-apt)")
        self.proc = subprocess.Popen([exe, *FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.port = self._port()
        self.ws: websocket.WebSocket | None = None
        self.next_id = 0
        self.events: list[dict[str, Any]] = []

    def _port(self, timeout: float = 60.0) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited {self.proc.returncode}: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                first = marker.read_text().splitlines()[0]
                return int(first)
            except (FileNotFoundError, IndexError, ValueError):
                time.sleep(0.05)  # chromium writes the file once it listens; there is nothing to wait on instead
        raise RuntimeError(f"chromium wrote no {marker} in {timeout}s")

    def _connect(self) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10) as resp:
            pages = [t for t in json.load(resp) if t.get("type") == "page"]
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60,
                                              suppress_origin=True)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self.ws is not None
        self.next_id += 1
        me = self.next_id
        self.ws.send(json.dumps({"id": me, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == me:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 60.0) -> dict[str, Any]:
        assert self.ws is not None
        for i, e in enumerate(self.events):
            if e["method"] == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.1, deadline - time.monotonic()))
            msg = json.loads(self.ws.recv())
            if msg.get("method") == method:
                return msg
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(f"no {method} in {timeout}s")

    def open(self, path: Path, checks: dict[str, str]) -> PageResult:
        """Load `path`, evaluate each check (a JavaScript expression) once the page says it is ready
        (`document.body.dataset.ready`), and screenshot the whole page."""
        self._connect()
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        self.call("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_event("Page.loadEventFired")
        result = PageResult()
        result.values = {name: self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"]
                         .get("value") for name, expr in checks.items()}
        metrics = self.call("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics["contentSize"]
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        result.screenshot = base64.b64decode(shot["data"])
        self.call("Runtime.evaluate", expression="1")  # drain events that arrived meanwhile
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                result.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                            for a in p.get("args", [])))
            elif e["method"] == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                result.errors.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
            elif e["method"] == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                result.errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return result

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
