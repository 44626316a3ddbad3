"""rlkube.local.ports.free_port: below the kernel's ephemeral range (which outgoing connections draw source ports
from while the caller has yet to bind), bindable, never the same port twice in one process."""

from __future__ import annotations

import socket

import pytest
from rlkube.local import ports


def test_ports_are_below_the_ephemeral_range_bindable_and_distinct():
    low = ports.ephemeral_low()
    if low is None or low - ports.LOWEST < 1000:
        pytest.skip("no room below this machine's ephemeral range")
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    assert all(ports.LOWEST <= p < low for p in picked), picked
    with socket.socket() as s:
        s.bind(("127.0.0.1", picked[-1]))


def test_a_bound_port_is_never_picked(monkeypatch):
    low = ports.ephemeral_low()
    if low is None or low - ports.LOWEST < 1000:
        pytest.skip("no room below this machine's ephemeral range")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        # Every random draw lands on the bound port first, then on the next one up.
        draws = iter([taken, taken + 1])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(ports, "_handed_out", set())
        if not ports._bindable(taken + 1):
            pytest.skip(f"port {taken + 1} is in use")
        assert ports.free_port() == taken + 1


def test_without_proc_the_kernel_picks(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    monkeypatch.setattr(ports, "_handed_out", set())
    assert ports.ephemeral_low() is None
    port = ports.free_port()
    assert port > 0 and port in ports._handed_out
