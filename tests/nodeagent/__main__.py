"""`python -m nodeagent` (with tests/ on sys.path): run the test node agent until SIGTERM or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import urllib3

from nodeagent.agent import NodeAgent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeagent", description=__doc__)
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--state-dir", required=True, type=Path, help="logs, pod directories, signals.jsonl")
    p.add_argument("--node-name", default=None)
    p.add_argument("--namespace", "-n", action="append", default=[], help="serve pods of this namespace")
    p.add_argument("--namespace-selector", default=None, help="serve namespaces with these labels (k=v,...)")
    p.add_argument("--backoff-base", type=float, default=1.0, help="first restart delay (kubelet: 10 s)")
    p.add_argument("--backoff-max", type=float, default=10.0, help="longest restart delay (kubelet: 300 s)")
    p.add_argument("--stop-grace", type=float, default=5.0, help="grace given to pods when the agent stops")
    p.add_argument("--threads", type=int, default=1, help="OMP/MKL threads the emulated image sets")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu the node advertises (none is used)")
    args = p.parse_args(argv)
    if not args.namespace and not args.namespace_selector:
        p.error("give --namespace or --namespace-selector: the agent never runs pods it was not told to")
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the test cluster is self-signed
    logging.basicConfig(level=logging.DEBUG if os.environ.get("NODEAGENT_DEBUG") else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent = NodeAgent(
        args.kubeconfig, args.state_dir, node_name=args.node_name, namespaces=tuple(args.namespace),
        namespace_selector=args.namespace_selector, backoff_base=args.backoff_base,
        backoff_max=args.backoff_max, stop_grace=args.stop_grace, threads=args.threads, gpus=args.gpus,
    )
    parent = os.getppid()

    def orphaned() -> None:  # the test session that started us died without stopping us: stop anyway
        while not stop.wait(1.0):
            if os.getppid() != parent:
                stop.set()

    try:
        agent.start()
        threading.Thread(target=orphaned, daemon=True, name="parent-watch").start()
        while not stop.wait(3600):
            pass
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
