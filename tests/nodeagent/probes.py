"""Readiness, liveness and startup probes, executed for real: an HTTP GET to the pod IP, a TCP connect,
or a command run inside the container's namespaces (`nsenter`). `Prober` keeps kubelet's schedule
(initialDelaySeconds, periodSeconds) and thresholds (successThreshold, failureThreshold).
"""

from __future__ import annotations

import http.client
import socket
import subprocess
from dataclasses import dataclass, field


def _port(port, container: dict) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"named port {port!r} not declared by container {container['name']!r}")


def run_once(probe: dict, container: dict, pod_ip: str, pid: int | None, env: dict[str, str]) -> tuple[bool, str]:
    """One probe execution -> (success, message for the Unhealthy event)."""
    timeout = float(probe.get("timeoutSeconds") or 1)
    try:
        if "httpGet" in probe:
            hg = probe["httpGet"]
            host, port = hg.get("host") or pod_ip, _port(hg.get("port"), container)
            cls = http.client.HTTPSConnection if hg.get("scheme") == "HTTPS" else http.client.HTTPConnection
            conn = cls(host, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in hg.get("httpHeaders") or []}
                conn.request("GET", hg.get("path") or "/", headers={"User-Agent": "kube-probe/1.20", **headers})
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        if "tcpSocket" in probe:
            ts = probe["tcpSocket"]
            with socket.create_connection((ts.get("host") or pod_ip, _port(ts["port"], container)), timeout=timeout):
                return True, ""
        if "exec" in probe:
            if pid is None:
                return False, "container not running"
            argv = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "--", *probe["exec"]["command"]]
            proc = subprocess.run(argv, env=env, capture_output=True, timeout=timeout, check=False)
            out = (proc.stdout + proc.stderr).decode(errors="replace").strip()
            return proc.returncode == 0, f"exec probe exited {proc.returncode}: {out[-200:]}"
        return False, f"probe type {sorted(probe)} is not supported by the rlkube test node agent"
    except subprocess.TimeoutExpired:
        return False, f"probe timed out after {timeout}s"
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return False, f"probe failed: {exc}"


@dataclass
class Prober:
    """One probe of one container run: created when the container starts, so counters reset on restart."""

    probe: dict
    started_at: float  # monotonic
    success: bool = False  # current verdict
    successes: int = 0
    failures: int = 0
    last_message: str = ""
    next_at: float = field(init=False)

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds") or 0)

    @property
    def period(self) -> float:
        return float(self.probe.get("periodSeconds") or 10)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, message: str, now: float) -> bool:
        """Apply one result; returns True when the verdict changed."""
        self.next_at = now + self.period
        before = self.success
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= int(self.probe.get("successThreshold") or 1):
                self.success = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            self.last_message = message
            if self.failures >= int(self.probe.get("failureThreshold") or 3):
                self.success = False
        return self.success != before

    @property
    def failed(self) -> bool:
        """For liveness/startup: failureThreshold consecutive failures."""
        return self.failures >= int(self.probe.get("failureThreshold") or 3)
