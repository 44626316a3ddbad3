"""The cluster's DNS for a real node (tests/cluster/node.py): Debian's dnsmasq, fed the Services' names.

Test infrastructure (not shipped). No CoreDNS is installable here (no registry, no Debian package), and the
operator's pods find each other by name (`{pod}.{service}:port`, controller/manifests/names.py; Redis at `{job}-redis`),
so a real DNS server answers them: dnsmasq, which re-reads the hosts files of its `--hostsdir` when they change.
A watcher (a thread of the test process) follows Services and Endpoints through the API server and rewrites one
hosts file, with the records CoreDNS's kubernetes plugin serves for them (docs/references.md §12):
- `<svc>.<ns>.svc.<domain>` -> the ClusterIP, or for a headless Service every endpoint address (ready, and not
  ready ones that the endpoints controller publishes for `publishNotReadyAddresses`);
- `<hostname>.<svc>.<ns>.svc.<domain>` -> the endpoint address whose `hostname` is set (a pod with
  `hostname` + `subdomain` equal to a headless Service's name, as the endpoints controller records it);
- `kubernetes.default.svc.<domain>` as any ClusterIP Service.
Everything else under the domain is NXDOMAIN (`--local`); other names go to the host's resolvers. No SRV, no
PTR of pods, no `<ip>.<ns>.pod` names, no ExternalName. Pods get the search path from the kubelet
(`clusterDNS`, `clusterDomain`), so `{pod}.{service}` resolves from inside the job's namespace.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cluster.control_plane import spawn, stop_group, wait_ready
from kubernetes import client, config, watch

DOMAIN = "cluster.local"


def records(services: dict[tuple[str, str], dict], endpoints: dict[tuple[str, str], dict],
            domain: str = DOMAIN) -> list[tuple[str, str]]:
    """(address, name) pairs for the Services and Endpoints (API dicts by (namespace, name)), sorted."""
    out: set[tuple[str, str]] = set()
    for (ns, name), svc in services.items():
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = (svc.get("spec") or {}).get("clusterIP")
        if cluster_ip and cluster_ip != "None":
            out.add((cluster_ip, fqdn))
            continue
        for subset in (endpoints.get((ns, name)) or {}).get("subsets") or []:
            for addr in (subset.get("addresses") or []) + (subset.get("notReadyAddresses") or []):
                out.add((addr["ip"], fqdn))
                if addr.get("hostname"):
                    out.add((addr["ip"], f"{addr['hostname']}.{fqdn}"))
    return sorted(out, key=lambda r: (r[1], r[0]))


@dataclass
class ClusterDNS:
    """dnsmasq listening on `address`:53, answering `domain` from the cluster's Services."""

    kubeconfig: Path
    workdir: Path
    address: str
    domain: str = DOMAIN
    proc: object = None
    _services: dict = field(default_factory=dict)
    _endpoints: dict = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _written: str | None = None

    @property
    def hosts_file(self) -> Path:
        return self.workdir / "hosts" / "cluster"

    def start(self) -> ClusterDNS:
        (self.workdir / "hosts").mkdir(parents=True, exist_ok=True)
        self.hosts_file.write_text("")
        self.proc = spawn(self.workdir, "dnsmasq", [
            "dnsmasq", "--keep-in-foreground", "--log-facility=-", "--conf-file=/dev/null", "--no-hosts",
            f"--listen-address={self.address}", "--bind-interfaces", "--port=53",
            f"--hostsdir={self.workdir / 'hosts'}", f"--local=/{self.domain}/", "--user=root", "--no-negcache",
            "--pid-file=",
        ])
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        core = client.CoreV1Api(api)
        for kind, lister, store in (("services", core.list_service_for_all_namespaces, self._services),
                                    ("endpoints", core.list_endpoints_for_all_namespaces, self._endpoints)):
            t = threading.Thread(target=self._follow, args=(api, lister, store), name=f"dns-{kind}", daemon=True)
            t.start()
            self._threads.append(t)
        wait_ready(self.proc, self.workdir / "dnsmasq.log",
                   lambda: "started, version" in (self.workdir / "dnsmasq.log").read_text(errors="replace"), 30)
        return self

    def _follow(self, api, lister, store: dict) -> None:
        """List, then watch from that list's resourceVersion; start over after an error or an expired watch."""
        while not self._stop.is_set():
            try:
                listed = api.sanitize_for_serialization(lister())
                with self._lock:
                    store.clear()
                    store.update({(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in listed["items"]})
                self._write()
                w = watch.Watch()
                for ev in w.stream(lister, resource_version=listed["metadata"]["resourceVersion"],
                                   timeout_seconds=5, _request_timeout=15):
                    obj = api.sanitize_for_serialization(ev["object"])
                    key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
                    with self._lock:
                        if ev["type"] == "DELETED":
                            store.pop(key, None)
                        else:
                            store[key] = obj
                    self._write()
                    if self._stop.is_set():
                        w.stop()
            except Exception:  # noqa: BLE001 - the API server restarting, a 410 Gone: list again
                self._stop.wait(0.5)

    def _write(self) -> None:
        with self._lock:
            lines = "".join(f"{ip} {name}\n" for ip, name in records(self._services, self._endpoints, self.domain))
            if lines == self._written:
                return
            self._written = lines
        # A rename is one inotify event with the whole file: dnsmasq never reads half of it.
        tmp = self.hosts_file.with_name(f".cluster.{threading.get_ident()}")
        tmp.write_text(lines)
        os.replace(tmp, self.hosts_file)

    def stop(self) -> None:
        self._stop.set()
        stop_group(self.proc)
        self.proc = None
        for t in self._threads:
            t.join(timeout=20)
        with contextlib.suppress(OSError):
            self.hosts_file.unlink()
