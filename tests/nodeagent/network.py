"""Pod networking, the way a CNI bridge plugin does it: one Linux bridge per node agent, one network
namespace per pod with a veth pair into the bridge and an address from the node's /24.

Why namespaces rather than 127.x.y.z aliases: every pod really owns its ports (two trainers' TCPStores on
:29500, a pod's redis on :6379 and another engineer's test on the same port never collide), servers that
bind 0.0.0.0 stay inside their pod, and `status.podIP` is an address other pods reach exactly as in a
cluster. The host (the agent, the operator, tests) reaches pods through the bridge address, which is also
the Node's InternalIP. Pods have no route beyond the node (no NAT): nothing here has network access anyway.

The bridge and its /24 are claimed through tests/cluster/subnets.py (one machine-wide lock with the real
node's bridges, so no two share a subnet), which records the agent as their owner; a later claim removes the
bridge and the named netns (under /run/netns) of an agent that died without cleaning up.
"""

from __future__ import annotations

import ipaddress
import threading

from cluster.subnets import NETNS_DIR, claim_bridge, release_bridge
from cluster.subnets import ip as _ip
from cluster.subnets import SubnetError as NetworkError

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

    def setup(self) -> PodNetwork:
        # 10.200-254.x.0/24: apart from the real node's 10.88-95 (tests/cluster/node.py).
        self.subnet = claim_bridge(self.bridge, range(200, 255), netns_prefix=self.netns_prefix)
        hosts = [str(h) for h in self.subnet.hosts()]
        self.gateway, self._free = hosts[0], hosts[1:]
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
        release_bridge(self.bridge, netns_prefix=self.netns_prefix)
