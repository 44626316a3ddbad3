"""A real Kubernetes control plane on loopback: etcd + kube-apiserver + kube-controller-manager.

Test infrastructure (not shipped): the binaries come from `build-control-plane.sh` (cached outside the repo,
or from KUBE_APISERVER_BIN / KUBE_CONTROLLER_MANAGER_BIN / ETCD_BIN). Every server gets a free port, its
own data directory and its own process group, and `stop()` leaves no process behind.

Run as a script to start one in the foreground and print its KUBECONFIG:
    python tests/cluster/control_plane.py [--dir DIR]
or to run one command against it, with its kubeconfig in place of `{kubeconfig}` and in $KUBECONFIG (`make bench`):
    python tests/cluster/control_plane.py --run rlkube bench operator --kubeconfig {kubeconfig}
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rlkube.bench import processes
from rlkube.local.ports import free_port

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("RLKUBE_CACHE", Path.home() / ".cache" / "rlkube"))
DEFAULT_BIN = CACHE / "k8s-1.20.2" / "bin"
TOKEN = "rlkube-test-token"


def log(msg: str) -> None:
    print(f"[control-plane {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def binaries(build: bool = True) -> dict[str, str]:
    """Paths of the three binaries; builds the cached ones first when absent and `build` is set."""
    apiserver = os.environ.get("KUBE_APISERVER_BIN") or str(DEFAULT_BIN / "kube-apiserver")
    kcm = os.environ.get("KUBE_CONTROLLER_MANAGER_BIN") or str(DEFAULT_BIN / "kube-controller-manager")
    if build and not (os.access(apiserver, os.X_OK) and os.access(kcm, os.X_OK)):
        log("kube-apiserver not cached; building it from Debian's source package (one time, several minutes)")
        subprocess.run(["bash", str(HERE / "build-control-plane.sh")], check=True)
    etcd = os.environ.get("ETCD_BIN") or shutil.which("etcd")
    if not etcd:
        raise RuntimeError("etcd not found: apt-get install etcd-server (or set ETCD_BIN)")
    for path in (apiserver, kcm):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is not an executable; run tests/cluster/build-control-plane.sh")
    return {"etcd": etcd, "apiserver": apiserver, "kcm": kcm}


def spawn(workdir: Path, name: str, argv: list[str]) -> subprocess.Popen:
    """Start a server logging to `workdir/name.log`, in its own session: a Ctrl-C in the terminal reaches us, not
    the servers, so their owner decides the order in which they stop."""
    return processes.spawn(argv, workdir / f"{name}.log")


def wait_ready(proc: subprocess.Popen, logpath: Path, ready, timeout: float) -> None:
    """Poll `ready()` until it holds; raise with the log's tail if the server exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = logpath.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{logpath.stem} exited with {proc.returncode}:\n{tail}")
        if ready():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{logpath.stem} not ready after {timeout}s; see {logpath}")


def stop_group(proc: subprocess.Popen | None, timeout: float = 15) -> None:
    """SIGTERM a server's process group, SIGKILL it after `timeout` seconds (nothing for None)."""
    if proc is not None:
        processes.stop(proc, timeout)


@dataclass
class ControlPlane:
    workdir: Path
    with_controller_manager: bool = True
    # AlwaysAllow for the shared test cluster; RBAC where a test checks what a ServiceAccount may do.
    authorization_mode: str = "AlwaysAllow"
    # A cluster with real nodes (tests/cluster/node.py) adds nodelifecycle: it lifts a new node's not-ready taint.
    controllers: str = "garbagecollector,namespace,serviceaccount-token,serviceaccount"
    # e.g. --kubelet-preferred-address-types=InternalIP: node names do not resolve here (logs, exec)
    extra_apiserver_args: list[str] = field(default_factory=list)
    # Serve pods as well (tests/cluster/node.py with kube-proxy): the API server listens on every address and
    # advertises this one (the `kubernetes` Service's endpoint), pods get ServiceAccount tokens (the admission
    # plugin), and their token Secrets carry the API server's certificate as ca.crt (kcm's --root-ca-file).
    advertise_address: str | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    api_port: int = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs[name] = spawn(self.workdir, name, argv)

    def _wait(self, name: str, ready, timeout: float) -> None:
        wait_ready(self.procs[name], self.workdir / f"{name}.log", ready, timeout)

    def _healthy(self, path: str) -> bool:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        req = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def start(self) -> ControlPlane:
        t0 = time.monotonic()
        bins = binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        d = self.workdir
        (d / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
        subprocess.run(
            ["openssl", "genrsa", "-out", str(d / "sa.key"), "2048"], check=True, capture_output=True
        )
        etcd_client, etcd_peer = free_port(), free_port()
        self._spawn(
            "etcd",
            [
                bins["etcd"], "--name", "rlkube", "--data-dir", str(d / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--advertise-client-urls", f"http://127.0.0.1:{etcd_client}",
                "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster", f"rlkube=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
            ],
        )
        self.api_port = free_port()
        self._spawn(
            "apiserver",
            [
                bins["apiserver"], f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                f"--token-auth-file={d / 'tokens.csv'}",
                *(["--bind-address=0.0.0.0", f"--advertise-address={self.advertise_address}"]
                  if self.advertise_address else ["--bind-address=127.0.0.1", "--disable-admission-plugins=ServiceAccount"]),
                f"--secure-port={self.api_port}", f"--cert-dir={d / 'certs'}",
                f"--authorization-mode={self.authorization_mode}",
                f"--service-account-key-file={d / 'sa.key'}",
                f"--service-account-signing-key-file={d / 'sa.key'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--api-audiences=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
                # Many jobs at once in the benchmarks: don't let the default limits throttle us.
                "--max-requests-inflight=1000", "--max-mutating-requests-inflight=500",
                *self.extra_apiserver_args,
            ],
        )
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: local, cluster: {{server: \"{self.url}\", insecure-skip-tls-verify: true}}}}]\n"
            f"users: [{{name: admin, user: {{token: {TOKEN}}}}}]\n"
            "contexts: [{name: local, context: {cluster: local, user: admin, namespace: default}}]\n"
            "current-context: local\n"
        )
        self._wait("apiserver", lambda: self._healthy("/readyz"), 90)
        if self.with_controller_manager:
            self._spawn(
                "kcm",
                [
                    bins["kcm"], f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                    f"--controllers={self.controllers}",
                    f"--service-account-private-key-file={d / 'sa.key'}",
                    "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--port=0",
                    f"--cert-dir={d / 'kcm-certs'}",
                    # The self-signed serving certificate (with its CA) that the API server wrote at start.
                    *([f"--root-ca-file={d / 'certs' / 'apiserver.crt'}"] if self.advertise_address else []),
                ],
            )
        log(f"ready in {time.monotonic() - t0:.1f}s at {self.url} (KUBECONFIG={self.kubeconfig})")
        return self

    def stop(self) -> None:
        for name in ("kcm", "apiserver", "etcd"):
            stop_group(self.procs.pop(name, None))

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(workdir: Path, command: list[str]) -> int:
    """Start a control plane, run `command` against it, stop it whatever happens; the command's exit status."""
    if not command:
        raise SystemExit("--run needs a command")
    with ControlPlane(workdir) as cp:
        argv = [a.replace("{kubeconfig}", str(cp.kubeconfig)) for a in command]
        # The servers are in their own sessions: a Ctrl-C reaches the command (and us), and `with` stops them.
        # KUBE_CONTROLLER_MANAGER_BIN: the bench's Job controller baseline runs this build's controller manager.
        env = {**os.environ, "KUBECONFIG": str(cp.kubeconfig), "KUBE_CONTROLLER_MANAGER_BIN": binaries(build=False)["kcm"]}
        return subprocess.run(argv, env=env).returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--build-only", action="store_true", help="build or find the binaries, then exit")
    parser.add_argument("--run", nargs=argparse.REMAINDER, default=None, metavar="COMMAND",
                        help="run COMMAND against the control plane ({kubeconfig} is replaced), then stop it")
    args = parser.parse_args()
    if args.build_only:
        print(binaries())
        return
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="rlkube-cp-"))
    if args.run is not None:
        sys.exit(run(workdir, args.run))
    # Blocked before anything starts, so a SIGTERM is waited for below instead of killing us and orphaning servers.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    cp = ControlPlane(workdir).start()
    print(f"export KUBECONFIG={cp.kubeconfig}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cp.stop()


if __name__ == "__main__":
    main()
