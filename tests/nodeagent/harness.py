"""Start and stop the node agent from tests and `make demo-cluster`, and read what it recorded.

The agent runs as its own process (own session, so a Ctrl-C reaches only the caller, which stops it in
order); `stop()` lets it stop its pods, unwire the network and delete its Node, and checks that no process
it started is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nodeagent.agent import MARKER
from support.waiting import wait_for  # noqa: F401 (the e2e tests import it from here)

TESTS_DIR = Path(__file__).resolve().parent.parent


@dataclass
class AgentProcess:
    kubeconfig: Path
    state_dir: Path
    namespace_selector: str | None = "rlkube.io/node-agent=true"
    namespaces: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """Added to the agent's environment (what image_env hands on: RLKUBE_VLLM_PYTHON, NODEAGENT_FAST_LLM_BIN)."""
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)

    def start(self, timeout: float = 60) -> AgentProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "nodeagent", "--kubeconfig", str(self.kubeconfig), "--state-dir", str(self.state_dir)]
        if self.namespace_selector:
            argv += ["--namespace-selector", self.namespace_selector]
        for ns in self.namespaces:
            argv += ["--namespace", ns]
        argv += list(self.extra_args)
        env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))}
        with open(self.state_dir / "agent.log", "ab") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        ready = self.state_dir / "agent.json"
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"node agent exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"node agent not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        return self

    @property
    def node_name(self) -> str:
        return self.info["node"]

    @property
    def node_ip(self) -> str:
        return self.info["nodeIP"]

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return (self.state_dir / "agent.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop_leaving_nothing(self) -> None:
        """stop(), then fail if a container process of this agent is still alive (every agent fixture's end)."""
        self.stop()
        left = self.live_processes()
        assert not left, f"container processes left after the node agent stopped: {[p.pid for p in left]}"

    def stop(self, timeout: float = 90) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise RuntimeError(f"node agent did not stop within {timeout}s:\n{self.log_tail()}") from None

    # ---- what the agent recorded ----------------------------------------------------------------------------
    def signals(self) -> list[dict]:
        path = self.state_dir / "signals.jsonl"
        if not path.exists():
            return []
        text = path.read_text()
        complete = text[: text.rfind("\n") + 1]  # the agent may be appending a line right now
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def pod_states(self, namespace: str | None = None) -> list[dict]:
        out = []
        for path in (self.state_dir / "pods").glob("*/state.json"):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if namespace is None or doc["namespace"] == namespace:
                doc["dir"] = str(path.parent)
                out.append(doc)
        return out

    def pod_state(self, namespace: str, name: str, uid: str | None = None) -> dict | None:
        """The newest pod of that name (pods are recreated under the same name)."""
        matches = [s for s in self.pod_states(namespace) if s["name"] == name and (uid is None or s["uid"] == uid)]
        matches.sort(key=lambda s: os.path.getmtime(Path(s["dir"]) / "state.json"))
        return matches[-1] if matches else None

    def container_log(self, namespace: str, name: str, container: str | None = None) -> str:
        state = self.pod_state(namespace, name)
        if state is None:
            return ""
        logs = Path(state["dir"]) / "logs"
        files = sorted(logs.glob(f"{container or '*'}/*.log"), key=lambda p: (p.parent.name, int(p.stem)))
        return "".join(f"==> {p.relative_to(logs)} <==\n{p.read_text(errors='replace')}" for p in files)

    def live_processes(self, namespace: str | None = None) -> list[psutil.Process]:
        """Processes still carrying a container marker of this agent (optionally: of one namespace's pods)."""
        agent_id = self.info.get("agentId", "")
        uids = None if namespace is None else {s["uid"] for s in self.pod_states(namespace)}
        found = []
        for proc in psutil.process_iter():
            try:
                mark = proc.environ().get(MARKER, "")
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            parts = mark.split("/")
            if len(parts) == 3 and parts[0] == agent_id and (uids is None or parts[1] in uids):
                found.append(proc)
        return found


def cluster_dns_argv(hosts_file: Path, argv: list[str]) -> list[str]:
    """Run `argv` on the host network but with the cluster's Service names resolvable, as an in-cluster
    process would have them: a private mount namespace where the agent's host view of the hosts file is
    bind-mounted on /etc/hosts (the agent rewrites that file in place as pods and Services change)."""
    script = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, str(hosts_file), *argv]


def pod_condition(pod, typ: str) -> str | None:
    """The status ("True"/"False") of a condition of a V1Pod, None when absent."""
    for cond in (pod.status.conditions or []) if pod and pod.status else []:
        if cond.type == typ:
            return cond.status
    return None
