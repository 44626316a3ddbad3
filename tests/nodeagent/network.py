"""Pod networking, the way a CNI bridge plugin does it: one Linux bridge per node agent, one network
namespace per pod with a veth pair into the bridge and an address from the node's /24.

Why namespaces rather than 127.x.y.z aliases: every pod really owns its ports (two trainers' TCPStores on
:29500, a pod's redis on :6379 and another engineer's test on the same port never collide), servers that
bind 0.0.0.0 stay inside their pod, and `status.podIP` is an address other pods reach exactly as in a
cluster. The host (the agent, the operator, tests) reaches pods through the bridge address, which is also
the Node's InternalIP. Pods have no route beyond the node (no NAT): nothing here has network access anyway.

Global state (a bridge, named netns under /run/netns) is created under a file lock with a per-agent id and
recorded in /run/rlkube-nodeagent/<id>.json; a later agent removes what a dead agent left behind.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import random
import subprocess
import threading
from contextlib import contextmanager
from pathlib import Path

STATE_ROOT = Path(os.environ.get("RLKUBE_NODEAGENT_RUN", "/run/rlkube-nodeagent"))
NETNS_DIR = Path("/run/netns")


class NetworkError(RuntimeError):
    pass


def _ip(*args: str, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], input=input, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@contextmanager
def _locked():
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _used_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default" and dst[0].isdigit():
            try:
                nets.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                pass
    return nets


def reclaim_stale() -> list[str]:
    """Remove bridges and namespaces of agents that died without cleaning up; returns what was removed."""
    removed = []
    for state in STATE_ROOT.glob("*.json"):
        try:
            doc = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        if _pid_alive(int(doc.get("pid", 0))):
            continue
        prefix = doc["netnsPrefix"]
        for ns in NETNS_DIR.glob(prefix + "*") if NETNS_DIR.exists() else []:
            _ip("netns", "del", ns.name, check=False)
            removed.append(ns.name)
        if _ip("link", "show", doc["bridge"], check=False):
            _ip("link", "del", doc["bridge"], check=False)
            removed.append(doc["bridge"])
        state.unlink(missing_ok=True)
    return removed


class PodNetwork:
    """The node's bridge and its address pool."""

    def __init__(self, agent_id: str):
        self.agent_id = agent_id
        self.bridge = f"rlkbr{agent_id}"
        self.netns_prefix = f"rlk{agent_id}-"
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway: str | None = None
        self._free: list[str] = []
        self._lock = threading.Lock()
        self.state_file = STATE_ROOT / f"{agent_id}.json"

    def setup(self) -> PodNetwork:
        with _locked():
            reclaim_stale()
            used = _used_networks()
            candidates = [ipaddress.ip_network(f"10.{a}.{b}.0/24") for a in range(200, 255) for b in range(256)]
            random.shuffle(candidates)
            for net in candidates:
                if not any(net.overlaps(u) for u in used):
                    self.subnet = net
                    break
            else:
                raise NetworkError("no free 10.x.y.0/24 for the pod network")
            hosts = [str(h) for h in self.subnet.hosts()]
            self.gateway, self._free = hosts[0], hosts[1:]
            self.state_file.write_text(
                json.dumps({"pid": os.getpid(), "bridge": self.bridge, "netnsPrefix": self.netns_prefix})
            )
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        return self

    def add_pod(self) -> tuple[str, str]:
        """A fresh namespace wired to the bridge; returns (pod IP, netns path)."""
        with self._lock:
            if not self._free:
                raise NetworkError(f"pod network {self.subnet} is full")
            ip = self._free.pop(0)
        suffix = ip.split(".")[-1]
        ns, veth = f"{self.netns_prefix}{suffix}", f"vrlk{self.agent_id}{suffix}"
        try:
            _ip("netns", "add", ns)
            # Two `ip -batch` runs do the wiring (host side, pod side) instead of six separate `ip` runs.
            _ip("-batch", "-", input=f"link add {veth} type veth peer name eth0 netns {ns}\n"
                f"link set {veth} master {self.bridge} up\n")
            _ip("-n", ns, "-batch", "-", input="link set lo up\n"
                f"addr add {ip}/{self.subnet.prefixlen} dev eth0\nlink set eth0 up\n"
                f"route add default via {self.gateway}\n")
        except NetworkError:
            _ip("netns", "del", ns, check=False)
            with self._lock:
                self._free.append(ip)
            raise
        return ip, str(NETNS_DIR / ns)

    def remove_pod(self, ip: str) -> None:
        suffix = ip.split(".")[-1]
        # Delete the veth pair explicitly: the kernel destroys a deleted namespace's devices asynchronously.
        _ip("link", "del", f"vrlk{self.agent_id}{suffix}", check=False)
        _ip("netns", "del", f"{self.netns_prefix}{suffix}", check=False)
        with self._lock:
            if ip not in self._free:
                self._free.append(ip)

    def teardown(self) -> None:
        with _locked():
            for ns in NETNS_DIR.glob(self.netns_prefix + "*") if NETNS_DIR.exists() else []:
                _ip("netns", "del", ns.name, check=False)
            _ip("link", "del", self.bridge, check=False)
            self.state_file.unlink(missing_ok=True)
