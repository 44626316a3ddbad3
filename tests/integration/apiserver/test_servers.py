"""The server fixtures are real and clean up after themselves."""

import time

import psutil

from cluster.control_plane import ControlPlane
from rlkube.local.redis_server import RedisServer


def test_redis_stream_roundtrip(redis_client):
    redis_client.xgroup_create("s", "g", id="0", mkstream=True)
    first = redis_client.xadd("s", {"tokens": b"\x01\x00"})
    redis_client.xadd("s", {"tokens": b"\x02\x00"})
    got = redis_client.xreadgroup("g", "c0", {"s": ">"}, count=1, block=1000, noack=True)
    [(stream, [(entry_id, fields)])] = got
    assert stream == b"s" and entry_id == first and fields == {b"tokens": b"\x01\x00"}
    groups = redis_client.xinfo_groups("s")
    assert groups[0]["entries-read"] == 1


def test_redis_is_flushed_between_tests(redis_client):
    assert redis_client.dbsize() == 0


def test_redis_server_stop_leaves_no_process(tmp_path):
    server = RedisServer(tmp_path).start()
    pid = server.proc.pid
    assert server.client().ping()
    server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_control_plane_stop_leaves_no_process(tmp_path):
    t0 = time.monotonic()
    cp = ControlPlane(tmp_path, with_controller_manager=True).start()
    pids = [p.pid for p in cp.procs.values()]
    assert cp._healthy("/readyz")
    print(f"cached control plane start: {time.monotonic() - t0:.1f}s")
    cp.stop()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
