"""tests/cluster/subnets.py with the machine's real `ip`: a pod bridge never takes a /24 another route already
covers (two routes to one subnet sent a real node's pod traffic to a bridge a killed run had left, so its operator
pod could neither be probed nor reach the API server), and a claim removes the bridges of owners that are gone."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import uuid

import pytest
from cluster import subnets

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates bridges: needs root")

OCTET = 199  # outside both the real node's 10.88-95 and the node agent's 10.200-254: no other bridge draws from it


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry of this test's own, the candidates in order (10.<OCTET>.0.0/24 first), and every bridge this test
    names removed at the end."""
    monkeypatch.setattr(subnets, "STATE_ROOT", tmp_path / "bridges")
    monkeypatch.setattr(subnets.random, "shuffle", lambda seq: None)
    names: list[str] = []

    def name() -> str:
        names.append(f"rkt{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield name
    for bridge in names:
        subnets.ip("link", "del", bridge, check=False)


def routes_to(net: ipaddress.IPv4Network) -> list[str]:
    return [r["dev"] for r in json.loads(subnets.ip("-j", "-4", "route"))
            if r.get("dst", "")[:1].isdigit() and ipaddress.ip_network(r["dst"], strict=False).overlaps(net)]


def test_a_second_claim_takes_the_next_free_subnet(registry):
    if routes_to(ipaddress.ip_network(f"10.{OCTET}.0.0/16")):
        pytest.skip(f"10.{OCTET}.0.0/16 is routed on this machine already")
    first, second = registry(), registry()
    a = subnets.claim_bridge(first, [OCTET])
    b = subnets.claim_bridge(second, [OCTET])
    assert (str(a), str(b)) == (f"10.{OCTET}.0.0/24", f"10.{OCTET}.1.0/24")
    assert routes_to(a) == [first] and routes_to(b) == [second]
    assert f"inet 10.{OCTET}.0.1/24" in subnets.ip("-4", "addr", "show", first)
    subnets.release_bridge(first)
    assert not subnets.ip("link", "show", first, check=False) and routes_to(a) == []
    assert not (subnets.STATE_ROOT / f"{first}.json").exists()
    assert (subnets.STATE_ROOT / f"{second}.json").exists()


def test_a_claim_removes_the_bridge_of_an_owner_that_is_gone(registry):
    if routes_to(ipaddress.ip_network(f"10.{OCTET}.0.0/16")):
        pytest.skip(f"10.{OCTET}.0.0/16 is routed on this machine already")
    stale, live, new = registry(), registry(), registry()
    # A bridge left by a process that has exited, on the first candidate, and one whose owner (this process) lives.
    dead = subprocess.Popen(["true"])
    dead.wait()
    for bridge, net, pid in ((stale, 0, dead.pid), (live, 1, os.getpid())):
        subnets.ip("link", "add", bridge, "type", "bridge")
        subnets.ip("addr", "add", f"10.{OCTET}.{net}.1/24", "dev", bridge)
        subnets.ip("link", "set", bridge, "up")
        subnets.STATE_ROOT.mkdir(exist_ok=True)
        (subnets.STATE_ROOT / f"{bridge}.json").write_text(json.dumps({"pid": pid, "bridge": bridge}))
    got = subnets.claim_bridge(new, [OCTET])
    assert not subnets.ip("link", "show", stale, check=False)
    assert subnets.ip("link", "show", live, check=False)
    assert str(got) == f"10.{OCTET}.0.0/24" and routes_to(got) == [new]


def test_no_free_subnet_is_an_error_naming_the_range():
    used = [ipaddress.ip_network(f"10.{OCTET}.0.0/16")]
    with pytest.raises(subnets.SubnetError, match=f"x in \\[{OCTET}\\]"):
        subnets.free_subnet([OCTET], used)
    assert str(subnets.free_subnet([OCTET, OCTET + 1], used)).startswith(f"10.{OCTET + 1}.")
