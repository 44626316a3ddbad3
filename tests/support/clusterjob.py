"""One TrainingJob on the real control plane, run by the real operator, its pods run by the test node agent.

Shared by the e2e tests and `make demo-cluster` (demo_cluster.py):
- `OperatorProcess`: `rlkube operator -n NS` as a child process (killed with -9 by the chaos tests);
- `ClusterJob`: apply a manifest, read the TrainingJob, wait for a condition on it, find the trainer's events
  in the job's own Redis (at the Redis pod's IP, password from the job's Secret), and read back what the node
  agent saw (teardown order, pods per name, leftover processes);
- `EventFollower`: a thread that follows the trainer's events stream (blocking XREAD, no polling) and keeps
  the per-step metrics (reward) and the `training_finished` event.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import redis
from cluster.control_plane import free_port
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from nodeagent.harness import AgentProcess, wait_for
from rlkube.lifecycle.roles import TEARDOWN_ORDER
from rlkube.controller.manifests import names
from rlkube.contract import protocol, runtime
from support import specs

EXAMPLE = specs.EXAMPLE_PATH
GROUP, VERSION, PLURAL = "rlkube.io", "v1alpha1", "trainingjobs"
TERMINAL = ("Succeeded", "Failed")


def read_job(custom, namespace: str, name: str) -> dict | None:
    """The TrainingJob object as stored (None once it is gone)."""
    try:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def example(**overrides) -> dict:
    """examples/tiny-cpu.yaml, with `overrides` given as dotted camelCase paths: {"spec.algorithm.maxSteps": 20}."""
    return specs.document(**overrides)


CHAOS_GRACE = {"actor": 3, "preprocessor": 3, "inference": 3, "trainer": 10, "redis": 3}


def chaos_example(max_steps: int, **overrides) -> dict:
    """example() for a job something is killed in mid-run, on either node: a checkpoint every 5 steps, and short
    completion and event timeouts and grace periods, so that a wrong outcome shows within the test's time."""
    return example(**{
        "spec.algorithm.maxSteps": max_steps,
        "spec.trainer.checkpoint.intervalSteps": 5,
        "spec.runPolicy.completionTimeoutSeconds": 30,
        "spec.runPolicy.eventTimeoutSeconds": 60,
        "spec.teardown.gracePeriodSeconds": CHAOS_GRACE,
        **overrides,
    })


@dataclass
class OperatorProcess:
    kubeconfig: Path
    namespace: str
    log_path: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    metrics_port: int = 0

    def start(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with open(self.log_path, "ab") as logf:
            logf.write(f"---- operator start #{self.starts + 1} ----\n".encode())
            logf.flush()
            # setpriv --pdeathsig: the operator dies with the test process that started it (no orphan).
            self.metrics_port = free_port()
            self.proc = subprocess.Popen(
                ["setpriv", "--pdeathsig", "KILL", "--", sys.executable, "-m", "rlkube.cli", "operator",
                 "-n", self.namespace, "--metrics-port", str(self.metrics_port)],
                env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.starts += 1
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (kopf stops its handlers), SIGKILL if it does not exit within 20 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def passes(self, job: str) -> int:
        """Reconcile passes this operator process made for `job`, from its Prometheus metrics (0 before the
        first pass or while it starts)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return 0
        needle = f'rlkube_reconcile_passes_total{{namespace="{self.namespace}",trainingjob="{job}"}}'
        return next((int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines() if line.startswith(needle)), 0)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class EventFollower(threading.Thread):
    """Follows the trainer's events stream from its first entry; survives the stream's Redis going away."""

    def __init__(self, locate, stream: str):
        """`locate()` -> (url, password) of the job's Redis now; asked again after every error, so a Redis pod
        that was replaced (new IP) is found again."""
        super().__init__(daemon=True, name="event-follower")
        self.locate, self.stream = locate, stream
        self.url: str | None = None
        self.metrics: list[dict] = []
        self.checkpoints: list[int] = []
        self.weights_ready: list[dict] = []
        self.finished: protocol.TrainerEvent | None = None
        self.step = 0
        self.events = 0
        self.errors: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        conn: redis.Redis | None = None
        last = "0-0"
        while not self._halt.is_set():
            try:
                if conn is None:
                    self.url, password = self.locate()
                    conn = redis.Redis.from_url(self.url, password=password, socket_connect_timeout=3,
                                                socket_timeout=5)
                got = conn.xread({self.stream: last}, block=1000, count=200)
                for _, entries in got or []:
                    for sid, fields in entries:
                        last = sid.decode() if isinstance(sid, bytes) else sid
                        self._record(protocol.decode_event(sid, fields))
            except Exception as exc:  # noqa: BLE001 - kept for the assertion messages; the thread must live on
                self.errors.append(f"{self.url}: {exc!r}")
                if conn is not None:
                    conn.close()
                    conn = None
                if self.finished is not None:
                    return  # Redis is torn down last: everything was read
                self._halt.wait(0.5)
                continue
            if self.finished is not None:
                break  # nothing after it matters, and the Redis pod is about to go away
        if conn is not None:
            conn.close()

    def _record(self, event: protocol.TrainerEvent | None) -> None:
        if event is None:
            return
        self.events += 1
        if event.step is not None:
            self.step = max(self.step, event.step)
        if event.type == protocol.METRICS:
            self.metrics.append(event.payload)
        elif event.type == protocol.WEIGHTS_READY:
            self.weights_ready.append(event.payload)
        elif event.type == protocol.CHECKPOINT_SAVED:
            self.checkpoints.append(int(event.step or 0))
        elif event.type == protocol.TRAINING_FINISHED and self.finished is None:
            self.finished = event

    def describe(self) -> str:
        """For assertion messages: what the follower read, and the last errors it met."""
        return (f"follower of {self.url}: {self.events} events read, step {self.step}, checkpoints {self.checkpoints}, "
                f"finished {self.finished}, last errors {self.errors[-5:]} ({len(self.errors)} in all)")

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=15)

    def rewards(self) -> list[float]:
        return [m["reward_mean"] for m in self.metrics if isinstance(m.get("reward_mean"), int | float)]

    def reward_margin(self, n: int = 10) -> float | None:
        """Mean reward of the last n steps minus that of the first n (what `rlkube local` reports)."""
        r = self.rewards()
        if len(r) < 2 * n:
            return None
        return sum(r[-n:]) / n - sum(r[:n]) / n


class PodRecorder(threading.Thread):
    """Every pod object created in a namespace, from a watch of the API (not only those the agent ran)."""

    def __init__(self, api_client: client.ApiClient, namespace: str):
        super().__init__(daemon=True, name="pod-recorder")
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.uids: dict[str, set[str]] = {}
        self._watch = watch.Watch()

    def run(self) -> None:
        rv = None
        while True:
            try:
                for ev in self._watch.stream(self.core.list_namespaced_pod, self.namespace, resource_version=rv,
                                             timeout_seconds=60):
                    meta = ev["object"].metadata
                    rv = meta.resource_version
                    self.uids.setdefault(meta.name, set()).add(meta.uid)
                if self._watch._stop:
                    return
            except Exception:  # noqa: BLE001 - relist after an expired watch or a dropped connection
                rv = None
                time.sleep(0.5)

    def stop(self) -> None:
        self._watch.stop()


@dataclass
class ClusterJob:
    api_client: client.ApiClient
    agent: AgentProcess
    namespace: str
    name: str = ""
    follower: EventFollower | None = None
    started_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.recorder = PodRecorder(self.api_client, self.namespace)
        self.recorder.start()

    # ---- the TrainingJob ------------------------------------------------------------------------------------
    def apply(self, manifest: dict) -> ClusterJob:
        self.name = manifest["metadata"]["name"]
        self.started_at = time.monotonic()
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest)
        return self

    def get(self) -> dict | None:
        return read_job(self.custom, self.namespace, self.name)

    def status(self) -> dict:
        return (self.get() or {}).get("status") or {}

    def step(self) -> int:
        return int((self.status().get("trainer") or {}).get("step") or 0)

    def delete(self) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)

    def wait(self, check, timeout: float, what: str):
        """Poll the TrainingJob until `check(job)` is truthy; the failure message carries the evidence."""
        try:
            return wait_for(lambda: check(self.get()), timeout, what, interval=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.diagnostics()}") from None

    def wait_phase(self, phases: tuple[str, ...], timeout: float) -> dict:
        return self.wait(lambda j: j if j and (j.get("status") or {}).get("phase") in phases else None,
                         timeout, f"TrainingJob {self.name} in {phases}")

    def wait_step(self, step: int, timeout: float) -> int:
        """Until the trainer has reported `step` (from the follower when running, else the status)."""
        def reached():
            seen = self.follower.step if self.follower else self.step()
            return seen if seen >= step else None
        try:
            return wait_for(reached, timeout, f"trainer step {step}", interval=0.1)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.diagnostics()}") from None

    # ---- pods and the job's Redis ---------------------------------------------------------------------------
    def pod(self, role: str, index: int = 0):
        try:
            return self.core.read_namespaced_pod(names.pod_name(self.name, role, index), self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def pid(self, role: str, index: int = 0) -> int:
        """The pid of the role's container process, as the node agent started it (waits until it runs)."""
        pod_name = names.pod_name(self.name, role, index)

        def running():
            state = self.agent.pod_state(self.namespace, pod_name)
            if not state:
                return None
            container = state["containers"].get(role)  # the role's (an hf:// or directory model adds an init one)
            if container is None:
                return None
            return container["pid"] if container["state"] == "running" and container["pid"] else None

        try:
            # 120 s: the role starts after the model init container (rlkube.core.hf.fetch), where there is one.
            return wait_for(running, 120, f"{pod_name} running", interval=0.1)
        except TimeoutError:
            raise AssertionError(
                f"{pod_name} never ran: {self.agent.pod_state(self.namespace, pod_name)}\n{self.diagnostics()}"
            ) from None

    def follow(self, timeout: float = 120) -> EventFollower:
        """Start following the trainer's events once the managed Redis pod is up."""
        def redis_pod():
            p = self.pod("redis")
            return p if p and p.status.pod_ip and p.status.phase == "Running" else None

        try:
            wait_for(redis_pod, timeout, f"{self.name}-redis running", interval=0.2)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.diagnostics()}") from None

        def locate() -> tuple[str, str | None]:
            p = redis_pod()
            if p is None:
                raise ConnectionError(f"{self.name}-redis is not running")
            secret = self.core.read_namespaced_secret(names.secret_name(self.name), self.namespace)
            return f"redis://{p.status.pod_ip}:{runtime.REDIS_PORT}/0", secret_password(secret)

        spec = self.get()["spec"]
        stream = protocol.StreamKeys.for_job(self.namespace, self.name, spec["trainer"].get("backend", "torch")).events
        self.follower = EventFollower(locate, stream)
        self.follower.start()
        return self.follower

    # ---- what the node agent saw ----------------------------------------------------------------------------
    def agent_signals(self, event: str | None = None) -> list[dict]:
        prefix = f"{self.name}-"
        return [s for s in self.agent.signals() if s["namespace"] == self.namespace and s["pod"].startswith(prefix)
                and (event is None or s["event"] == event)]

    def order(self, event: str = "deletion") -> list[str]:
        """Roles in the order the node agent saw `event` for their pods, consecutive repeats collapsed. Deletions
        go in the order the API server made them (their resourceVersion), where the agent has it for all: two
        deletions a few ms apart reach the agent in one watch batch, and its threads log them in any order."""
        signals = self.agent_signals(event)
        if event == "deletion" and signals and all("rv" in s for s in signals):
            signals = sorted(signals, key=lambda s: s["rv"])
        roles: list[str] = []
        for s in signals:
            if not roles or roles[-1] != s["role"]:
                roles.append(s["role"])
        return roles

    def uids_per_pod(self) -> dict[str, set[str]]:
        """Every pod object created for this job, by name (a recreated pod gets a new uid): the API's watch
        view, plus the node agent's (which ran them)."""
        out: dict[str, set[str]] = {k: set(v) for k, v in self.recorder.uids.items() if k.startswith(f"{self.name}-")}
        for s in self.agent.pod_states(self.namespace):
            if s["name"].startswith(f"{self.name}-"):
                out.setdefault(s["name"], set()).add(s["uid"])
        return out

    def children_left(self) -> list[str]:
        sel = f"{names.LABEL_JOB}={self.name}"
        left = [f"pod/{p.metadata.name}" for p in self.core.list_namespaced_pod(self.namespace, label_selector=sel).items]
        left += [f"service/{s.metadata.name}" for s in self.core.list_namespaced_service(self.namespace, label_selector=sel).items]
        left += [f"secret/{s.metadata.name}" for s in self.core.list_namespaced_secret(self.namespace, label_selector=sel).items]
        left += [f"configmap/{c.metadata.name}" for c in self.core.list_namespaced_config_map(self.namespace, label_selector=sel).items]
        left += [f"networkpolicy/{n.metadata.name}" for n in client.NetworkingV1Api(self.api_client)
                 .list_namespaced_network_policy(self.namespace, label_selector=sel).items]
        return left

    def leftover_processes(self) -> list[str]:
        return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in self.agent.live_processes(self.namespace)]

    def diagnostics(self) -> str:
        st = self.status()
        lines = [(f"phase={st.get('phase')} reason={st.get('reason')} message={st.get('message')} "
                  f"progress={st.get('progress')} teardown={st.get('teardown')}")]
        for c in st.get("conditions") or []:
            lines.append(f"  {c['type']}={c['status']} {c.get('reason')}: {c.get('message', '')}")
        if self.follower is not None:
            lines.append(f"  {self.follower.describe()}")
        try:
            for p in self.core.list_namespaced_pod(self.namespace).items:
                cs = (p.status.container_statuses or [None])[0]
                lines.append(f"  pod {p.metadata.name} {p.status.phase} restarts={cs.restart_count if cs else '-'}")
        except ApiException:
            pass
        for role in ("trainer", "actor", "inference", "preprocessor", "redis"):
            name = names.pod_name(self.name, role, 0)
            log = self.agent.container_log(self.namespace, name)
            if log:
                lines.append(f"---- {name} (last lines) ----\n" + "\n".join(log.splitlines()[-8:]))
        return "\n".join(lines)


def secret_password(secret) -> str | None:
    import base64

    data = (secret.data or {}).get(names.SECRET_KEY)
    return base64.b64decode(data).decode() if data else None


def stage_names(status: dict) -> list[str]:
    return [s["name"] for s in (status.get("teardown") or {}).get("stages") or []]


FULL_ORDER = list(TEARDOWN_ORDER)
POD_ORDER = list(specs.POD_ORDER)  # the pods' deletion order (no sandbox pods)

# Mean reward of the last 10 steps minus the first 10 (what `rlkube local` reports). For seed 0 both `rlkube
# local` and a cluster run of examples/tiny-cpu.yaml measured 0.15-0.19 here (first-10 ~0.06, last-10 ~0.21-0.25);
# pipelined runs are not bit-reproducible, so the bar sits below that yet far above no learning (~0).
MIN_MARGIN = 0.10


def run_to_success_and_learn(job: ClusterJob, manifest: dict, steps: int, label: str, min_margin: float,
                             timeout: float = 600) -> dict:
    """Apply `manifest`, follow the trainer's events, wait for the end: Succeeded at `steps`, the reward margin
    (last 10 vs first 10 steps) at least `min_margin`; prints `label`'s figures. Returns the final status."""
    t0 = time.monotonic()
    job.apply(manifest)
    follower = job.follow()
    st = job.wait_phase(TERMINAL, timeout)["status"]
    assert st["phase"] == "Succeeded", job.diagnostics()
    assert st["completion"]["finalStep"] == steps and st["trainer"]["step"] == steps
    follower.stop()
    margin, rewards = follower.reward_margin(), follower.rewards()
    assert margin is not None, f"too few metrics events for a margin: {rewards}"
    print(f"\n{label}: {time.monotonic() - t0:.1f}s, reward first-10 {sum(rewards[:10]) / 10:.3f} last-10 "
          f"{sum(rewards[-10:]) / 10:.3f} (margin {margin:.3f})")
    assert margin >= min_margin, rewards
    return st
