"""A test-only environment for tests/e2e/real_node/test_real_node_sandbox.py, mounted into the actor pods (a claim on
PYTHONPATH): the calculator's episodes, whose first episodes in each actor also send the hostile snippets of PROBES to
the job's sandbox (rlkube.core.actor.sandbox_client through the sandbox pods) and log each result as one line
`SANDBOX-PROBE {json}` for the test to read from the actor's log, then one `SANDBOX-TIMING {json}`: a tool call's
median and p99 through the sandbox pod and in the actor's own process. Before them the actor itself connects once to the
test's listener (`actor-control`), so the test knows the listener is reachable from a pod.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from typing import Any

from rlkube.core.actor.calculator import Calculator, CalculatorEpisode

SECRET_PATHS = ("/etc/rlkube/job.json", "/var/run/secrets/kubernetes.io/serviceaccount/token",
                "/tmp/rlkube-actor-marker")


def probes(host: str, port: int) -> dict[str, str]:
    return {
        "socket": (f"import socket\ns = socket.create_connection(({host!r}, {port}), timeout=3)\n"
                   "s.sendall(b'snippet')\nprint('connected')\n"),
        "read": ("import glob, json, os\nfound = {}\n"
                 f"for p in {SECRET_PATHS!r}:\n"
                 "    try:\n        found[p] = open(p).read()[:200]\n    except OSError as e:\n"
                 "        found[p] = type(e).__name__\n"
                 "envs = []\nfor p in glob.glob('/proc/[0-9]*/environ'):\n"
                 "    try:\n        envs.append(open(p, 'rb').read().decode(errors='replace'))\n"
                 "    except OSError:\n        pass\n"
                 "print(json.dumps({'files': found, 'environ': envs, 'own_env': dict(os.environ)}))\n"),
        "fork": "import os\nn = 0\nwhile True:\n    os.fork()\n    n += 1\n",
        "write": ("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'0' * 2 ** 20)\n"
                  "print('wrote 1 GiB')\n"),
        "ok": "print(6 * 7)\nprint(open('/proc/version').read().strip())\n",
    }


class Probe(Calculator):
    name = "sandbox-probe"

    def __init__(self, sandbox: Any, host: str, port: int, rounds: int = 1, **calculator: Any):
        super().__init__(**calculator)
        self.sandbox, self.host, self.port, self.rounds = sandbox, host, int(port), int(rounds)
        self.episodes = 0
        with open("/tmp/rlkube-actor-marker", "w") as f:  # a file of the actor's that no snippet may read
            f.write("actor-only")

    def start(self, prompt):
        episode = super().start(prompt)
        self.episodes += 1
        if self.episodes <= self.rounds:
            return ProbeEpisode(episode, self, self.episodes)
        return episode


class ProbeEpisode:
    def __init__(self, inner: CalculatorEpisode, env: Probe, number: int):
        # Its own number: the actor starts a whole group of episodes before the first reply comes back.
        self.inner, self.env, self.number, self.sent = inner, env, number, False

    def respond(self, reply: str):
        if self.sent:
            return self.inner.respond(reply)
        self.sent = True
        if self.number == 1:
            with socket.create_connection((self.env.host, self.env.port), timeout=5) as s:
                s.sendall(b"actor-control")
        out = []
        for name, code in probes(self.env.host, self.env.port).items():
            result = self.env.sandbox.run(code)
            line = {"probe": name, "episode": self.number, **result.to_json()}
            print("SANDBOX-PROBE " + json.dumps(line), file=sys.stderr, flush=True)
            out.append({"role": "tool", "content": result.message()[:200]})
        if self.number == 1:
            print("SANDBOX-TIMING " + json.dumps(self.timing()), file=sys.stderr, flush=True)
        return out

    def timing(self, n: int = 10) -> dict:
        """A tool call through the sandbox pod vs in this actor's process (rlkube bench sandbox's numbers)."""
        from rlkube.bench.sandbox import summarize, time_calls
        from rlkube.core.actor.sandbox import Sandbox

        local = Sandbox(self.env.sandbox.limits)
        # The probes may have cost a sandbox pod its life (the fork loop under gVisor can take the pod past its memory
        # limit; the actor then answers `unavailable` and the pod is replaced): time the pods once every server
        # answers again, and say how long that took.
        t0, answered = time.monotonic(), 0
        while answered < 2 * len(getattr(self.env.sandbox, "urls", [""])) and time.monotonic() - t0 < 300:
            answered = answered + 1 if self.env.sandbox.run("print(1)").outcome == "ok" else 0
            if not answered:
                time.sleep(1)  # a pod coming back: the next try is a second away, not a busy loop
        return {"pod_back_after_s": round(time.monotonic() - t0, 1),
                "pod": summarize(time_calls(self.env.sandbox.run, n)),
                "in_process": summarize(time_calls(local.run, n)),
                "in_process_layers": local.run("print(1)").layers}  # what held here (no netns under runc's seccomp)

    def reward(self) -> float:
        return self.inner.reward()


def factory(sandbox: Any, host: str, port: int, rounds: int = 1) -> Probe:
    return Probe(sandbox, host, port, rounds)
