"""The pod bridges of this machine's nodes (the real node's CNI bridge, tests/cluster/node.py, and the node
agent's, tests/nodeagent/network.py): each a /24 that no route of the machine overlaps, claimed under one
machine-wide lock (docs/references.md §10).

Why it is checked rather than drawn at random: two bridges with the same /24 give the kernel two routes to it, and
the older one wins, so a new node's pods can neither be reached (the kubelet's probes: "no route to host") nor
reach anything (their replies leave by the other bridge). A process killed before it removed its bridge (a
cancelled run) leaves one behind, so a claim also removes the bridges whose recorded owner is gone.

The same goes for the directory of named network namespaces (netns_dir_shared).

The bridge is created, with the subnet's first address (the gateway: the CNI bridge plugin keeps an existing bridge
and address), inside the lock, so its route exists before another claim looks.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import random
import subprocess
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

STATE_ROOT = Path(os.environ.get("RLKUBE_BRIDGES_RUN", "/run/rlkube-bridges"))
NETNS_DIR = Path("/run/netns")


class SubnetError(RuntimeError):
    pass


def ip(*args: str, input: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], input=input, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise SubnetError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@contextmanager
def locked() -> Iterator[None]:
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def used_networks() -> list[ipaddress.IPv4Network]:
    """The destinations of every IPv4 route of every table."""
    nets = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default" and dst[0].isdigit():
            try:
                nets.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                pass
    return nets


def free_subnet(second_octets: Iterable[int], used: list[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """A 10.<a>.<b>.0/24, `a` one of `second_octets`, that overlaps none of `used`."""
    candidates = [ipaddress.ip_network(f"10.{a}.{b}.0/24") for a in second_octets for b in range(256)]
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise SubnetError(f"no free 10.x.y.0/24 with x in {list(second_octets)} for a pod bridge")


def netns_dir_shared() -> None:
    """/run/netns a shared mount of its own, as `ip netns add` makes it on first use, before anything mounts a
    namespace there. containerd's CNI plugin mounts its pods' namespaces (cni-*) into the plain directory; when
    `ip netns add` (the node agent) later bind-mounts the directory over itself, those mounts stay underneath, out
    of reach: `ip netns delete` then fails with "Device or resource busy" and the namespace outlives its node."""
    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    if str(NETNS_DIR) not in points:
        subprocess.run(["mount", "--rbind", str(NETNS_DIR), str(NETNS_DIR)], check=True, capture_output=True)
    subprocess.run(["mount", "--make-rshared", str(NETNS_DIR)], check=True, capture_output=True)


def reclaim_stale() -> list[str]:
    """Under the lock: remove the bridges (and the network namespaces named with their recorded prefix) whose
    owner process is gone; returns what was removed."""
    removed = []
    for state in STATE_ROOT.glob("*.json"):
        try:
            doc = json.loads(state.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(doc.get("pid", 0))):
            continue
        prefix = doc.get("netnsPrefix")
        for ns in NETNS_DIR.glob(prefix + "*") if prefix and NETNS_DIR.exists() else []:
            ip("netns", "del", ns.name, check=False)
            removed.append(ns.name)
        if ip("link", "show", doc["bridge"], check=False):
            ip("link", "del", doc["bridge"], check=False)
            removed.append(doc["bridge"])
        state.unlink(missing_ok=True)
    return removed


def claim_bridge(bridge: str, second_octets: Iterable[int], netns_prefix: str | None = None) -> ipaddress.IPv4Network:
    """Create `bridge`, up, on a free /24 (its first address on the bridge) and record this process as its owner;
    returns the subnet."""
    octets = list(second_octets)
    with locked():
        reclaim_stale()
        subnet = free_subnet(octets, used_networks())
        gateway = next(subnet.hosts())
        (STATE_ROOT / f"{bridge}.json").write_text(json.dumps(
            {"pid": os.getpid(), "bridge": bridge, "subnet": str(subnet), "netnsPrefix": netns_prefix}))
        try:
            ip("link", "add", bridge, "type", "bridge")
            ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", bridge)
            ip("link", "set", bridge, "up")
        except SubnetError:
            ip("link", "del", bridge, check=False)
            (STATE_ROOT / f"{bridge}.json").unlink(missing_ok=True)
            raise
    return subnet


def release_bridge(bridge: str, netns_prefix: str | None = None) -> None:
    """Delete `bridge` (and the namespaces named with `netns_prefix`) and its record."""
    with locked():
        for ns in NETNS_DIR.glob(netns_prefix + "*") if netns_prefix and NETNS_DIR.exists() else []:
            ip("netns", "del", ns.name, check=False)
        ip("link", "del", bridge, check=False)
        (STATE_ROOT / f"{bridge}.json").unlink(missing_ok=True)
