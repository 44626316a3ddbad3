"""`rlkube bench sandbox`: what one tool call costs through a sandbox server (spec.sandbox.mode `pods`) against in
the actor's process (mode `process`): median and p99 seconds of `run(code)` for the same snippet.

In process: rlkube.core.actor.sandbox.Sandbox, as an actor runs it. Through a server: the actor's client
(rlkube.core.actor.sandbox_client.RemoteSandbox) to `python -m rlkube.core.sandbox`, started here on 127.0.0.1
(the HTTP hop and the server's own thread on top of the same child process), or to `--url` (a sandbox pod's
address, to include the pod's network and its runtime, e.g. gVisor). The real-node test prints the same numbers
from inside an actor pod against a sandbox pod (tests/e2e/real_node/test_real_node_sandbox.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

SNIPPET = "print(sum(range(1000)))"


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median, p99 (nearest rank), min and max in milliseconds, and the count."""
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered) + 0.5) - 1))]
    return {"n": len(ordered), "median_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * p99,
            "min_ms": 1000 * ordered[0], "max_ms": 1000 * ordered[-1]}


def time_calls(run: Callable[[str], object], n: int, code: str = SNIPPET, warmup: int = 2) -> list[float]:
    """Wall seconds of each of `n` calls (after `warmup` unmeasured ones); a call that does not answer `ok` fails."""
    out = []
    for i in range(warmup + n):
        t0 = time.perf_counter()
        result = run(code)
        took = time.perf_counter() - t0
        if getattr(result, "outcome", "ok") != "ok":
            raise RuntimeError(f"the snippet did not run: {result}")
        if i >= warmup:
            out.append(took)
    return out


def _local_server(port: int) -> subprocess.Popen:
    from rlkube.contract import runtime

    env = {**os.environ, runtime.ENV_BIND_HOST: "127.0.0.1", runtime.ENV_PORT: str(port),
           runtime.ENV_SANDBOX_REQUIRE_NETNS: "0"}
    proc = subprocess.Popen([sys.executable, "-m", "rlkube.core.sandbox"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("the sandbox server exited at start") from None
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("the sandbox server did not answer in 60 s")


def measure(n: int, url: str | None = None) -> dict:
    from rlkube.core.actor.sandbox import Sandbox
    from rlkube.core.actor.sandbox_client import RemoteSandbox
    from rlkube.local.ports import free_port

    local = Sandbox()
    results = {"snippet": SNIPPET, "in_process": summarize(time_calls(local.run, n)),
               "in_process_layers": list(local.layers)}
    proc = None
    if url is None:
        port = free_port()
        proc = _local_server(port)
        url = f"http://127.0.0.1:{port}"
    try:
        remote = RemoteSandbox([url], local.limits)
        results["server"] = summarize(time_calls(remote.run, n))
        results["server_url"] = url
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results["overhead_median_ms"] = results["server"]["median_ms"] - results["in_process"]["median_ms"]
    return results


def cli(args: argparse.Namespace) -> int:
    results = measure(args.n, args.url)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"tool call `{SNIPPET}`, {args.n} calls each:")
    for key, label in (("in_process", "in process (actor's child)"), ("server", f"sandbox server {results['server_url']}")):
        r = results[key]
        print(f"  {label:<48} median {r['median_ms']:7.1f} ms   p99 {r['p99_ms']:7.1f} ms   "
              f"(min {r['min_ms']:.1f}, max {r['max_ms']:.1f})")
    print(f"  the server's hop adds {results['overhead_median_ms']:.1f} ms at the median")
    return 0
