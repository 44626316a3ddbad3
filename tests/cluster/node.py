"""A real Kubernetes node on this machine: kube-scheduler, and a kubelet on containerd + runc + the CNI bridge.

Test infrastructure (not shipped). The node agent (tests/nodeagent) runs pods as host processes; this runs them
as the real kubelet does, in containers, so what a hardened pod asks for (uid 10001, a read-only root, dropped
capabilities), termination messages, restarts and volumes are enforced by the real parts. How it was made to
work on this machine kind (2 cores, root, no Docker, no registry) is docs/references.md §8 and §10:
- kubelet, kube-scheduler and the sandbox's `pause` binary come from the same Debian source as the API server
  (tests/cluster/build-control-plane.sh); containerd, runc, the CNI plugins, buildah and busybox-static from
  Debian's packages.
- Images are built with buildah from scratch (no registry serves a base here), pushed to an OCI archive and
  imported into containerd's k8s.io namespace; pods use them with imagePullPolicy Never.
- containerd runs with its own root, state, socket and CNI configuration, so it never meets a system one.
  `restrict_oom_score_adj` is required here: containerd gives sandboxes oom_score_adj -998, which this machine
  refuses, and every sandbox would fail at `runc create`.
- The kubelet runs without QoS cgroups or node allocatable enforcement (cgroupfs driver), anonymous and
  AlwaysAllow (a test cluster only), on free ports.

With `cluster_services`, the node also serves what pods of a real cluster rely on (docs/references.md §12):
- kube-proxy (same source, iptables mode), so the `kubernetes` Service's ClusterIP reaches the API server
  (started with an `advertise_address`) from pods: the operator's Deployment runs in the cluster;
- the cluster's DNS (tests/cluster/dns.py: dnsmasq on the bridge's gateway address, the kubelet's clusterDNS);
- the project's images from buildah's storage (`make images`), imported through OCI archives cached by image id.

Every process gets its own session and `stop()` ends them, removes the pods' containers and the bridge, and
kube-proxy's rules (`kube-proxy --cleanup`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from cluster.control_plane import CACHE, DEFAULT_BIN, TOKEN, ControlPlane, log, spawn, stop_group, wait_ready
from cluster.dns import ClusterDNS
from cluster.subnets import claim_bridge, netns_dir_shared, release_bridge
from cluster.tracked import track
from rlkube.local.ports import free_port

PAUSE_IMAGE = "localhost/rlkube/pause:3.4.1"
BUSYBOX_IMAGE = "localhost/rlkube/busybox:test"
CNI_BIN = Path("/usr/lib/cni")
PACKAGES = ("containerd", "runc", "containernetworking-plugins", "buildah", "busybox-static", "dnsmasq-base", "runsc")
RUNSC_HANDLER = "runsc"
"""containerd's runtime handler for gVisor (when runsc is installed): a RuntimeClass's `handler`."""
# containerd's runc shim drives Debian's runsc (which ships no containerd-shim-runsc-v1) through this wrapper, which
# mends four things between them (docs/guide/sandbox.md, "gVisor on a node"):
# - runsc 20221219 decides that it was left in the host's network namespace when /proc/sys/net/core/rmem_default
#   exists in the pod's, which holds for every namespace since kernel 5.15's per-namespace net.core sysctls: it
#   refuses every pod ("cannot run with network enabled in root network namespace"). Each runsc call runs in a mount
#   namespace of its own (a slave of the host's) whose /proc/sys has kernel, vm and fs but an empty net.
# - A pod's app container is a runsc subcontainer of the pause container's sandbox, and `runsc start` hands its own
#   stdio to it; the shim runs `start` with stdout/stderr on a pipe it reads to EOF, which the sandbox then holds for
#   the container's life, so the shim never returned from starting the task. `create` leaves a holder process with
#   the container's stdio (the pipes the shim gave `create`), and `start` runs on those instead.
# - `runsc create` of a subcontainer reports the sandbox's pid, which exits only with the pod, so the shim would never
#   see the app container exit. The holder's pid is reported instead: it waits for `start`, then for the container
#   (`runsc wait`) and exits with its status.
# - The shim takes a kill that fails with "container not running" (runc's words) for a process already gone, and
#   anything else for an error: runsc says "sandbox is not running" for a pod whose sandbox has exited, so the CRI
#   plugin could never delete a stopped pod (StopPodSandbox failed for ever). `kill` says it in runc's words.
RUNSC_WRAPPER = r"""#!/bin/sh
RUNSC=@RUNSC@
runsc() {
  unshare -m --propagation slave /bin/sh -ec '
mkdir -p /run/rlkube-runsc-sys
mount --bind /proc/sys /run/rlkube-runsc-sys
mount -t tmpfs -o size=16k rlkube-runsc /proc/sys
for d in kernel vm fs; do mkdir /proc/sys/$d; mount --bind /run/rlkube-runsc-sys/$d /proc/sys/$d; done
mkdir /proc/sys/net
exec "$0" "$@"' "$RUNSC" "$@"
}
cmd= root= log= bundle= pidfile= prev=
for a in "$@"; do
  case "$prev" in --root) root=$a;; --log) log=$a;; --bundle) bundle=$a;; --pid-file) pidfile=$a;; esac
  case "$a" in create|start|delete|kill) [ -n "$cmd" ] || cmd=$a;; esac
  prev=$a
done
id=$prev
d=${log%/*}
case "$cmd" in
create)
  grep -q '"io.kubernetes.cri.container-type" *: *"container"' "$bundle/config.json" || { runsc "$@"; exit $?; }
  runsc "$@" || exit $?
  mkfifo "$d/rlkube-started"
  /bin/sh -c 'read rc < "$0/rlkube-started" || exit 255; [ "$rc" = 0 ] || exit 255
out=$("$1" --root "$2" --log "$0/log.json" --log-format json wait "$3" </dev/null 2>/dev/null) || exit 255
status=$(printf "%s" "$out" | sed -n "s/.*\"exitStatus\": *\([0-9]*\).*/\1/p")
exit "${status:-255}"' "$d" "$RUNSC" "$root" "$id" &
  echo $! > "$d/rlkube-holder"
  printf %s $! > "$pidfile"
  ;;
start)
  [ -p "$d/rlkube-started" ] || { runsc "$@"; exit $?; }
  h=$(cat "$d/rlkube-holder")
  exec </proc/$h/fd/0 >/proc/$h/fd/1 2>/proc/$h/fd/2
  runsc "$@"; rc=$?
  echo $rc > "$d/rlkube-started"
  exit $rc
  ;;
delete)
  runsc "$@"; rc=$?
  if [ -p "$d/rlkube-started" ]; then  # a holder still waiting for a start that never came: let it go
    h=$(cat "$d/rlkube-holder")
    ! kill -0 "$h" 2>/dev/null || timeout 2 sh -c 'echo deleted > "$0"' "$d/rlkube-started"
    rm -f "$d/rlkube-started" "$d/rlkube-holder"
  fi
  exit $rc
  ;;
kill)
  out=$(runsc "$@" 2>&1) && exit 0
  rc=$?
  case "$out" in *"is not running"*) echo "container not running: $out" >&2;; *) printf '%s\n' "$out" >&2;; esac
  exit $rc
  ;;
*) runsc "$@"; exit $?;;
esac
"""
# OCI archives of images from buildah's storage, by tag and image id (the latest build of each tag): a node imports
# an unchanged image without a push.
ARCHIVES = CACHE / "images" / "oci"
# containerd's root (content and unpacked snapshots) kept between runs by the node that holds its lock, so an
# unchanged image is not imported again (the core image takes a minute to unpack on 2 cores); a second node at
# the same time gets a root of its own.
IMAGE_STORE = CACHE / "containerd"
# One kube-proxy per machine: each rewrites the whole of the KUBE-* chains, and `--cleanup` removes them all, so a
# second node with cluster services waits for the first one's stop.
PROXY_LOCK = Path("/run/rlkube-kube-proxy.lock")
ROUTE_LOCALNET = Path("/proc/sys/net/ipv4/conf/all/route_localnet")
# Where the kubelet writes each container run's log, <namespace>_<pod>_<pod uid>/<container>/<restart count>.log:
# a fixed path, the same for every node here (docs/references.md §10).
POD_LOGS = Path("/var/log/pods")


def stored_image_id(ref: str) -> str:
    """The id of image `ref` in buildah's default storage (where `make images` puts it)."""
    got = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"image {ref} is not in buildah's storage (make images): {got.stderr.strip()}")
    return got.stdout.strip()


def node_binaries() -> dict[str, str]:
    """kubelet, kube-scheduler, kube-proxy and pause from the cache (build-control-plane.sh builds them with the
    API server)."""
    bins = {name: str(DEFAULT_BIN / name) for name in ("kubelet", "kube-scheduler", "kube-proxy", "pause")}
    if not all(os.access(p, os.X_OK) for p in bins.values()):
        log("kubelet not cached; building the control plane and node binaries (one time, several minutes)")
        subprocess.run(["bash", str(Path(__file__).resolve().parent / "build-control-plane.sh")], check=True)
    for tool in ("containerd", "runc", "buildah", "ctr", "dnsmasq", "iptables"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: apt-get install {' '.join(PACKAGES)}")
    return bins


@dataclass
class Node:
    """One node, `name`, registered with `cp` (whose controller manager must run nodelifecycle: it removes the
    node's not-ready taint)."""

    cp: ControlPlane
    workdir: Path
    name: str = field(default_factory=lambda: f"node-{uuid.uuid4().hex[:6]}")
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # kube-proxy and the cluster's DNS (the control plane needs an advertise_address and the endpoint controller)
    cluster_services: bool = False
    # Images of buildah's default storage (`make images`) to import, e.g. localhost/rlkube/core:0.1.0.
    images: tuple[str, ...] = ()
    # The buildah image id of each of `images` as the caller built it: the tag can move meanwhile (another checkout
    # on this machine building the same tag from other sources), the id cannot. Resolved from the tag when absent.
    image_ids: dict[str, str] = field(default_factory=dict)
    dns: ClusterDNS | None = None
    import_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A unix socket path holds at most 107 bytes; pytest's tmp paths can be longer.
        self.sockdir = Path(tempfile.mkdtemp(prefix="rlkube-node-", dir="/run"))
        self.socket = self.sockdir / "containerd.sock"
        self.bridge = f"rk{uuid.uuid4().hex[:8]}"
        # The pod subnet and the bridge plugin's gateway (its first address; the cluster DNS listens there),
        # claimed at start (tests/cluster/subnets.py).
        self.subnet = ""
        self.gateway = ""

    # -- processes -------------------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.procs[name] = spawn(self.workdir, name, argv)

    def _wait(self, name: str, ready, timeout: float) -> None:
        wait_ready(self.procs[name], self.workdir / f"{name}.log", ready, timeout)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
                              capture_output=True, text=True, check=check)

    # -- configuration ---------------------------------------------------------------------------------------

    def _take_root(self) -> None:
        """containerd's root: the shared image store when no other node holds it, else one in the workdir."""
        self.root = self.workdir / "containerd" / "root"
        if not self.images:
            return
        IMAGE_STORE.mkdir(parents=True, exist_ok=True)
        lock = open(IMAGE_STORE / ".lock", "w")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            log(f"{IMAGE_STORE} is in use by another node: importing into a root of this node's own")
            return
        self._store_lock = lock
        self.root = IMAGE_STORE / "root"

    def _remove_containers(self) -> None:
        """Every container (and its snapshot) of the k8s.io namespace: a kept root starts and ends with images
        only, whatever a previous node left in it."""
        ids = self.ctr("containers", "list", "-q", check=False).stdout.split()
        if ids:
            self.ctr("containers", "delete", *ids, check=False)

    def _containerd_config(self) -> Path:
        d = self.workdir / "containerd"
        (d / "cni").mkdir(parents=True, exist_ok=True)
        (d / "cni" / "10-rlkube.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": self.bridge,
            "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet}]],
                          "dataDir": str(d / "ipam"), "routes": [{"dst": "0.0.0.0/0"}]}},
                {"type": "loopback"},
            ],
        }))
        config = d / "config.toml"
        config.write_text(f"""version = 2
root = "{self.root}"
state = "{self.sockdir / 'state'}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.sockdir / 'ttrpc.sock'}"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
{self._runsc_handler()}  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "{self.registry_hosts}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{d / 'cni'}"
""")
        return config

    @property
    def registry_hosts(self) -> Path:
        """containerd's registry host configuration (`config_path`): a `<host[:port]>/hosts.toml` per registry,
        read at every pull, so a registry can be trusted while the node runs (trust_registry)."""
        return self.workdir / "containerd" / "certs.d"

    def trust_registry(self, host: str) -> None:
        """Pull from the plain-HTTP registry at `host` (`127.0.0.1:5000`), as a node's containerd is set up for an
        insecure registry: a hosts.toml whose server is http://host."""
        d = self.registry_hosts / host
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts.toml").write_text(f'server = "http://{host}"\n\n[host."http://{host}"]\n'
                                      '  capabilities = ["pull", "resolve"]\n  skip_verify = true\n')

    def _runsc_handler(self) -> str:
        """The `runsc` runtime handler (gVisor) when Debian's runsc is installed: containerd's runc shim driving runsc
        (Debian ships no containerd-shim-runsc-v1; runsc speaks runc's command line) through RUNSC_WRAPPER. A
        RuntimeClass whose handler is `runsc` asks for gVisor's sentry, on the ptrace platform (this VM offers no
        usable KVM: `runsc --platform=kvm` hangs)."""
        runsc = shutil.which("runsc")
        if runsc is None:
            return ""
        wrapper = self.workdir / "containerd" / "runsc"
        wrapper.write_text(RUNSC_WRAPPER.replace("@RUNSC@", runsc))
        wrapper.chmod(0o755)
        return f"""    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{RUNSC_HANDLER}]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.{RUNSC_HANDLER}.options]
        BinaryName = "{wrapper}"
        SystemdCgroup = false
"""

    def _kubelet_config(self) -> Path:
        config = self.workdir / "kubelet.yaml"
        config.write_text(json.dumps({
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "cgroupDriver": "cgroupfs", "failSwapOn": False, "cgroupsPerQOS": False, "enforceNodeAllocatable": [],
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "readOnlyPort": 0, "port": free_port(), "healthzPort": free_port(), "healthzBindAddress": "127.0.0.1",
            "evictionHard": {}, "clusterDomain": "cluster.local",
            # No image garbage collection: it measures the whole disk this node shares with builds and other
            # checkouts, and past 85% (the default) it deleted images the tests had just imported (ImagePullBackOff:
            # nothing can pull them back here). Every image here is one the tests imported and need.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            **({"clusterDNS": [self.gateway]} if self.cluster_services else {}),
            # Pod status reaches the API server within a second of a container's change (the default is 10 s).
            "nodeStatusUpdateFrequency": "4s", "syncFrequency": "2s",
        }))
        return config

    # -- images ----------------------------------------------------------------------------------------------

    def _buildah(self, *args: str) -> str:
        storage = ["--root", str(self.workdir / "buildah"), "--runroot", str(self.sockdir / "buildah"),
                   "--storage-driver", "vfs"]
        out = subprocess.run(["buildah", *storage, *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args)}: {out.stderr[-2000:]}")
        return out.stdout.strip()

    def import_scratch_image(self, ref: str, files: dict[str, Path], user: str, entrypoint: list[str] | None) -> None:
        """Build image `ref` from scratch holding `files` (path in the image -> host file), and import it."""
        c = self._buildah("from", "scratch")
        try:
            for dest, src in files.items():
                self._buildah("copy", "--chmod", "0755", c, str(src), dest)
            config = ["config", "--user", user]
            if entrypoint:
                config += ["--entrypoint", json.dumps(entrypoint)]
            self._buildah(*config, c)
            self._buildah("commit", "--quiet", c, ref)
        finally:
            self._buildah("rm", c)
        self.import_image(ref)

    def import_stored_image(self, ref: str) -> float:
        """Import image `ref` from buildah's default storage (where `make images` puts it); the seconds it took."""
        t0 = time.monotonic()
        image_id = self.image_ids.get(ref) or stored_image_id(ref)
        marker = self.root / "rlkube-imported" / ref.replace("/", "_").replace(":", "_")
        if marker.is_file() and marker.read_text() == image_id and self.ctr("images", "list", "-q").stdout.split().count(ref):
            self.import_seconds[ref] = time.monotonic() - t0
            return self.import_seconds[ref]
        stem = ref.replace("/", "_").replace(":", "_")
        archive = ARCHIVES / f"{stem}@{image_id}.tar"
        if not archive.is_file():
            ARCHIVES.mkdir(parents=True, exist_ok=True)
            for old in ARCHIVES.glob(f"{stem}@*.tar"):  # an earlier build of the same tag
                old.unlink(missing_ok=True)
            tmp = archive.with_name(f".{archive.name}.{os.getpid()}")
            out = subprocess.run(["buildah", "push", "--quiet", image_id, f"oci-archive:{tmp}:{ref}"],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise RuntimeError(f"buildah push {ref}: {out.stderr[-2000:]}")
            os.replace(tmp, archive)
        self.ctr("images", "import", str(archive))
        marker.parent.mkdir(exist_ok=True)
        marker.write_text(image_id)
        self.import_seconds[ref] = time.monotonic() - t0
        return self.import_seconds[ref]

    def import_image(self, ref: str) -> None:
        """Import image `ref` from this node's buildah storage into containerd."""
        archive = self.workdir / f"{ref.replace('/', '_').replace(':', '_')}.tar"
        self._buildah("push", ref, f"oci-archive:{archive}:{ref}")
        self.ctr("images", "import", str(archive))
        archive.unlink()

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> Node:
        t0 = time.monotonic()
        bins = node_binaries()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._netns_before = cni_netns()
        self._pod_logs_before = _pod_log_dirs()
        # The bridge exists, up with its gateway address, before containerd and any pod: the bridge plugin keeps
        # an existing bridge and address, and the cluster DNS listens there. 10.88-95.x.0/24: apart from the node
        # agent's 10.200-254.
        subnet = claim_bridge(self.bridge, range(88, 96))
        netns_dir_shared()
        self.subnet, self.gateway = str(subnet), str(next(subnet.hosts()))
        self._take_root()
        self._spawn("containerd", ["containerd", "--config", str(self._containerd_config())])
        self._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 30)
        self._remove_containers()
        self.import_scratch_image(PAUSE_IMAGE, {"/pause": Path(bins["pause"])}, "65535:65535", ["/pause"])
        busybox = Path("/bin/busybox")
        self.import_scratch_image(BUSYBOX_IMAGE, {"/bin/busybox": busybox, "/bin/sh": busybox}, "10001:10001", None)
        for ref in self.images:
            log(f"imported {ref} in {self.import_stored_image(ref):.1f}s")
        if self.cluster_services:
            self._start_cluster_services(bins)
        self._spawn("scheduler", [bins["kube-scheduler"], f"--kubeconfig={self.cp.kubeconfig}", "--leader-elect=false",
                                  "--port=0", "--secure-port=0"])
        self._spawn("kubelet", [
            bins["kubelet"], f"--kubeconfig={self.cp.kubeconfig}", f"--config={self._kubelet_config()}",
            "--container-runtime=remote", f"--container-runtime-endpoint=unix://{self.socket}",
            f"--pod-infra-container-image={PAUSE_IMAGE}", f"--root-dir={self.workdir / 'kubelet'}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}", f"--hostname-override={self.name}", "--v=1",
        ])
        self._wait("kubelet", self._ready, 120)
        log(f"node {self.name} ready in {time.monotonic() - t0:.1f}s (containerd {self.socket})")
        return self

    def _start_cluster_services(self, bins: dict[str, str]) -> None:
        if not self.cp.advertise_address:
            raise ValueError("cluster_services needs a control plane with an advertise_address")
        self._proxy_lock = open(PROXY_LOCK, "w")  # noqa: SIM115 - held until stop()
        try:
            fcntl.flock(self._proxy_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log("another node's kube-proxy runs on this machine; waiting for it to stop")
            fcntl.flock(self._proxy_lock, fcntl.LOCK_EX)
        # kube-proxy turns route_localnet on (for localhost node ports); put back as it was on stop.
        self._route_localnet = ROUTE_LOCALNET.read_text()
        self.dns = ClusterDNS(self.cp.kubeconfig, self.workdir / "dns", self.gateway).start()
        self.procs["dnsmasq"] = self.dns.proc
        # conntrack and oom_score_adj values of 0 leave the machine's settings alone (this machine refuses a
        # negative oom_score_adj, see the containerd note above).
        self._spawn("kube-proxy", [
            bins["kube-proxy"], f"--kubeconfig={self.cp.kubeconfig}", "--proxy-mode=iptables",
            f"--cluster-cidr={self.subnet}", f"--hostname-override={self.name}", "--oom-score-adj=0",
            "--conntrack-max-per-core=0", "--conntrack-min=0", "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0", f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--healthz-bind-address=127.0.0.1:{free_port()}", "--v=1",
        ])

    def _ready(self) -> bool:
        """Registered, Ready, and without the not-ready/unreachable taints (nodelifecycle removes them)."""
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        req = urllib.request.Request(f"{self.cp.url}/api/v1/nodes/{self.name}",
                                     headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                node = json.loads(resp.read())
        except OSError:
            return False
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))
        taints = [t for t in node.get("spec", {}).get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
        return ready and not taints

    def stop(self) -> None:
        for name in ("kubelet", "scheduler"):
            stop_group(self.procs.pop(name, None))
        if self.dns is not None:
            self.dns.stop()
            self.procs.pop("dnsmasq", None)
        if self.procs.get("kube-proxy") is not None:
            stop_group(self.procs.pop("kube-proxy"))
            subprocess.run([str(DEFAULT_BIN / "kube-proxy"), "--cleanup"], capture_output=True)
            # --cleanup (1.20) leaves the canary chains its iptables monitor made.
            for table in ("mangle", "nat", "filter"):
                subprocess.run(["iptables", "-t", table, "-X", "KUBE-PROXY-CANARY"], capture_output=True)
            ROUTE_LOCALNET.write_text(self._route_localnet)
        if getattr(self, "_proxy_lock", None) is not None:
            self._proxy_lock.close()
            self._proxy_lock = None
        # The pods' containers and sandboxes (runc processes and their shims) end with containerd's tasks.
        if "containerd" in self.procs and self.procs["containerd"].poll() is None:
            tasks = self.ctr("tasks", "list", "-q", check=False).stdout.split()
            for task in tasks:
                self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
            for task in tasks:
                self.ctr("tasks", "delete", "--force", task, check=False)
            self._remove_containers()
        stop_group(self.procs.pop("containerd", None))
        if getattr(self, "_store_lock", None) is not None:
            self._store_lock.close()
            self._store_lock = None
        # The shims name the socket; runsc's sandbox and gofer processes (the `runsc` handler), which outlive a
        # shim killed before them, name this node's state directory: both lie under sockdir.
        for shim in _processes_with(f"{self.sockdir}/"):
            with contextlib.suppress(OSError):
                os.kill(shim, signal.SIGKILL)
        release_bridge(self.bridge)
        # The pods' network namespaces (the CRI plugin's cni-*), which a sandbox stopped with its runtime keeps.
        for name in cni_netns() - getattr(self, "_netns_before", set()):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        # The kubelet bind-mounts its root over itself and mounts the pods' volumes (memory emptyDirs), containerd
        # the sandboxes' /dev/shm: none outlives its process on its own.
        _unmount_under([self.workdir, self.sockdir])
        shutil.rmtree(self.sockdir, ignore_errors=True)
        # The pods' log directories that appeared while this node ran: the kubelet removes one only when it
        # garbage-collects the pod's sandbox, minutes after the pod is gone, and never at exit. (A second node on
        # this machine at the same time would lose its own; the tests never run two, tests/conftest.py.)
        for name in _pod_log_dirs() - getattr(self, "_pod_logs_before", set()):
            shutil.rmtree(POD_LOGS / name, ignore_errors=True)

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def running(cp: ControlPlane, workdir: Path, **node_args) -> Iterator[Node]:
    """`cp` started and a Node of it (with `node_args`) running on `workdir`, both tracked for the session's
    process check; at the end both are stopped, and after a clean end nothing of the node may be left: no mount
    under its directory, no pod network namespace, no pod log directory."""
    cp.start()
    for name, proc in cp.procs.items():
        track(name, proc.pid)
    n = Node(cp, workdir, **node_args)
    netns_before, pod_logs_before = cni_netns(), _pod_log_dirs()
    try:
        n.start()
        for name, proc in n.procs.items():
            track(name, proc.pid)
        yield n
    finally:
        n.stop()
        cp.stop()
    left = [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(n.workdir) in line]
    assert not left, f"mounts left behind by the node: {left}"
    assert not cni_netns() - netns_before, "network namespaces left behind by the node"
    assert not _pod_log_dirs() - pod_logs_before, f"pod log directories left in {POD_LOGS} by the node"


def _pod_log_dirs() -> set[str]:
    return {p.name for p in POD_LOGS.iterdir()} if POD_LOGS.is_dir() else set()


def cni_netns() -> set[str]:
    netns = Path("/var/run/netns")
    return {p.name for p in netns.iterdir() if p.name.startswith("cni-")} if netns.is_dir() else set()


def _unmount_under(roots: list[Path]) -> None:
    """Lazily unmount every mount point below `roots`, deepest first."""
    prefixes = [str(Path(r).resolve()) for r in roots]
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].replace("\\040", " ")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            points.append(point)
    for point in sorted(set(points), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _processes_with(text: str) -> list[int]:
    """Pids whose command line mentions `text` (containerd's shims name its socket)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(entry.name))
    return pids

