"""Cluster DNS without a DNS server: the /etc/hosts a pod sees, computed from Services and pods.

Pure functions. What kube-dns/CoreDNS would answer for headless Services, written as hosts entries:
- `{svc}.{ns}.svc.cluster.local` (and `{svc}.{ns}.svc`, `{svc}.{ns}`) -> every ready pod the selector picks
  (not-ready ones too when `publishNotReadyAddresses` is set); plain `{svc}` only inside namespace `ns`,
  because /etc/hosts has no search path;
- `{hostname}.{subdomain}.{ns}.svc.cluster.local` (same short forms) -> that pod, when a headless Service
  named `subdomain` selects it.
A pod that is terminating or finished drops out, as it drops out of the Endpoints. ClusterIP Services are
resolved to their pods too (the agent does no port translation: the operator's contract is port == targetPort).
"""

from __future__ import annotations

from collections.abc import Iterable

DOMAIN = "cluster.local"


def pod_ready(pod: dict) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _selects(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _names(base: str, ns: str, local: bool) -> list[str]:
    names = [f"{base}.{ns}.svc.{DOMAIN}", f"{base}.{ns}.svc", f"{base}.{ns}"]
    return names + [base] if local else names


def service_records(pods: Iterable[dict], services: Iterable[dict]) -> list[tuple[str, str, str]]:
    """(namespace, relative name, ip) for every name Services make resolvable; sorted, deduplicated."""
    pods = list(pods)
    out: set[tuple[str, str, str]] = set()
    for svc in services:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        spec = svc.get("spec") or {}
        headless = spec.get("clusterIP") == "None"
        for pod in pods:
            st = pod.get("status") or {}
            ip = st.get("podIP")
            if pod["metadata"]["namespace"] != ns or not ip or not _selects(spec.get("selector") or {}, pod):
                continue
            if pod["metadata"].get("deletionTimestamp") or st.get("phase") in ("Succeeded", "Failed"):
                continue
            if not (pod_ready(pod) or spec.get("publishNotReadyAddresses")):
                continue
            out.add((ns, name, ip))
            pspec = pod.get("spec") or {}
            if headless and pspec.get("hostname") and pspec.get("subdomain") == name:
                out.add((ns, f"{pspec['hostname']}.{name}", ip))
    return sorted(out)


def hosts_file(
    records: Iterable[tuple[str, str, str]],
    namespace: str | None = None,
    pod_ip: str | None = None,
    hostname: str | None = None,
    subdomain: str | None = None,
    host_aliases: Iterable[dict] = (),
) -> str:
    """The file for one pod (namespace set) or for the host view (namespace None: fully qualified names)."""
    lines = [
        "# Kubernetes-managed hosts file (rlkube test node agent): rewritten in place as pods and Services change.",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
    ]
    if pod_ip and hostname:
        if subdomain and namespace:
            lines.append(f"{pod_ip}\t{hostname}.{subdomain}.{namespace}.svc.{DOMAIN}\t{hostname}")
        else:
            lines.append(f"{pod_ip}\t{hostname}")
    for alias in host_aliases:
        lines.append(f"{alias['ip']}\t" + " ".join(alias.get("hostnames") or []))
    by_ip: dict[str, list[str]] = {}
    for ns, rel, ip in records:
        by_ip.setdefault(ip, []).extend(_names(rel, ns, local=(ns == namespace)))
    lines.append("# Services")
    for ip in sorted(by_ip):
        lines.append(f"{ip}\t" + " ".join(by_ip[ip]))
    return "\n".join(lines) + "\n"
