"""One thread per pod on the node: sandbox, containers, restarts, probes, status, and the kill sequence.

The life of a pod, as kubelet lives it:
1. sandbox: a network namespace with the pod IP (or the node's network for hostNetwork pods), the pod's
   /etc/hosts and /etc/resolv.conf, its volumes;
2. init containers one at a time, then every container, each started through `podinit.py` in its own
   process group with its log in `<pod dir>/logs/<container>/<restartCount>.log`;
3. exits handled by restartPolicy (Always / OnFailure restart in place with a doubling back-off and
   restartCount+1; Never leaves the container terminated and the pod Failed);
4. probes executed on their schedule: readiness sets the container's `ready`, liveness and startup
   failures restart it;
5. on deletion: SIGTERM to every container's process group, up to deletionGracePeriodSeconds to exit, then
   SIGKILL; only when every process is gone is the pod object removed (grace 0, uid precondition).
Status is recomputed after every change and patched only when it differs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from nodeagent import probes, volumes
from nodeagent.envvars import ConfigError, container_argv, container_env
from nodeagent.podstatus import Container, PodView, exit_code_of, pod_status

if TYPE_CHECKING:
    from nodeagent.agent import NodeAgent

log = logging.getLogger("nodeagent.worker")
PODINIT = str(Path(__file__).with_name("podinit.py"))
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"  # no DNS server: fail fast, use hosts
RETRY_S = 2.0  # config/volume errors are retried this often (kubelet retries on its sync loop)
STATUS_RETRY_S = 1.0  # a status patch the API server did not take (timeout, 5xx under load) is sent again
MIN_GRACE_S = 2.0  # kubelet's minimumGracePeriodInSeconds: even a grace-0 delete gets 2 s before SIGKILL


TERMINATION_LOG = "/dev/termination-log"  # a container's default terminationMessagePath
MAX_TERMINATION_MESSAGE = 4096


def killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class PodWorker(threading.Thread):
    def __init__(self, agent: NodeAgent, pod: dict):
        meta, spec = pod["metadata"], pod["spec"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.ns, self.pod_name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.role = (meta.get("labels") or {}).get("rlkube.io/role")
        self.dir = agent.pods_dir / f"{self.ns}_{self.pod_name}_{self.uid}"
        self.hosts_path = self.dir / "etc-hosts"
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self.deletion_seen = False
        # When the agent's watch first showed the deletion: the signal log's deletion time. The worker thread may
        # get to it later, and out of order with other pods' workers on a loaded machine.
        self.deletion_seen_at: float | None = None
        # The API server's resourceVersion of the first write that deleted the pod (its deletionTimestamp, or the
        # removal itself): it orders deletions as the API server made them, where the times the agent saw two of
        # them may tie (one watch batch) or come out of order across the workers' threads.
        self.deletion_rv: int | None = None
        self.grace: float | None = None  # deletionGracePeriodSeconds, shortened by later deletes
        self.gone = False  # the API object no longer exists (force-deleted)
        self.gone_at: float | None = None
        self.stop_grace: float | None = None  # the agent is shutting down
        self.netns: str | None = None
        self.view = PodView(
            restart_policy=spec.get("restartPolicy") or "Always",
            init=[Container(c["name"], c.get("image", ""), init=True) for c in spec.get("initContainers") or []],
            main=[Container(c["name"], c.get("image", "")) for c in spec["containers"]],
            host_ip=agent.node_ip,
        )
        self.specs = {c["name"]: c for c in [*(spec.get("initContainers") or []), *spec["containers"]]}
        self.procs: dict[str, subprocess.Popen] = {}
        self.envs: dict[str, dict[str, str]] = {}
        self.probers: dict[str, dict[str, probes.Prober]] = {}
        self.next_start: dict[str, float] = {}
        self.backoff: dict[str, float] = {}
        self.pending_restart: set[str] = set()
        self.volumes: dict[str, Path] | None = None
        self.retry_at = 0.0
        self.last_status: dict | None = None  # the status the API server has taken
        self.status_unsent = False
        self.conditions: list[dict] = []
        self.sent_events: set[tuple[str, str]] = set()
        self.network_released = False

    # ---- called from the agent's dispatcher thread ------------------------------------------------------
    def update(self, pod: dict) -> None:
        with self._lock:
            self.pod = pod
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                self.deletion_seen = True
                self.deletion_seen_at = self.deletion_seen_at or time.time()
                self.deletion_rv = self.deletion_rv or _rv(meta)
                g = float(meta.get("deletionGracePeriodSeconds") or 0)
                self.grace = g if self.grace is None else min(self.grace, g)
        self.wake.set()

    def object_deleted(self, meta: dict | None = None) -> None:
        with self._lock:
            if not self.gone:
                self.gone, self.gone_at = True, time.monotonic()
                self.deletion_seen_at = self.deletion_seen_at or time.time()
                self.deletion_rv = self.deletion_rv or (_rv(meta) if meta else None)
        self.wake.set()

    def shutdown(self, grace: float) -> None:
        with self._lock:
            self.stop_grace = grace
        self.wake.set()

    @property
    def hostname(self) -> str:
        return (self.pod["spec"].get("hostname") or self.pod_name)[:63]

    @property
    def terminal(self) -> bool:
        return (self.last_status or {}).get("phase") in ("Succeeded", "Failed")

    # ---- the thread ----------------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._setup()
            while not self._stopping():
                self._step(time.monotonic())
                self._sync_status()
                if self.terminal and not self.network_released:
                    self._release_network()
                self.wake.wait(self._next_due(time.monotonic()))
                self.wake.clear()
            self._terminate()
        except Exception:
            log.exception("pod %s/%s: worker failed; killing its processes", self.ns, self.pod_name)
            for proc in self.procs.values():
                killpg(proc.pid, signal.SIGKILL)
        finally:
            self._release_network()
            self.agent.worker_finished(self)

    def _stopping(self) -> bool:
        with self._lock:
            return self.deletion_seen or self.gone or self.stop_grace is not None

    def _setup(self) -> None:
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "work").mkdir(exist_ok=True)
        self.view.start_time = time.time()
        if self.pod["spec"].get("hostNetwork"):
            self.view.pod_ip = self.agent.node_ip
        else:
            self.view.pod_ip, self.netns = self.agent.network.add_pod()
        (self.dir / "resolv.conf").write_text(RESOLV_CONF)
        self.agent.write_hosts(self)
        self._sync_status()

    def _release_network(self) -> None:
        if not self.network_released and self.netns:
            self.agent.network.remove_pod(self.view.pod_ip)
        self.network_released = True

    def _event_once(self, typ: str, reason: str, message: str) -> None:
        if (reason, message) not in self.sent_events:
            self.sent_events.add((reason, message))
            self.agent.event(self.pod, typ, reason, message)

    # ---- containers ----------------------------------------------------------------------------------------
    def _step(self, now: float) -> None:
        if self.terminal:
            return
        if self.volumes is None:
            if now < self.retry_at:
                return
            try:
                self.volumes = volumes.prepare(
                    self.pod, self.dir, self.agent.lookup, self.agent.claim_dir, self.view.pod_ip, self.agent.node_ip
                )
            except (volumes.VolumeError, ConfigError) as exc:  # ConfigError: a Secret/ConfigMap read failed
                self._event_once("Warning", "FailedMount", str(exc))
                for c in [*self.view.init, *self.view.main]:
                    c.reason, c.message = "ContainerCreating", str(exc)
                self.retry_at = now + RETRY_S
                return
        for c in self.view.init:
            if c.state == "terminated" and c.exit_code == 0:
                continue
            self._advance(c, now)
            return  # one init container at a time; the others wait for it
        for c in self.view.main:
            self._advance(c, now)

    def _advance(self, c: Container, now: float) -> None:
        if c.state == "running":
            rc = self.procs[c.name].poll()
            if rc is None:
                self._probe(c, now)
                return
            self._on_exit(c, rc, now)
        if c.state == "waiting" and now >= self.next_start.get(c.name, 0.0):
            self._start(c, now)

    def _start(self, c: Container, now: float) -> None:
        spec = self.specs[c.name]
        try:
            env = {**self.agent.image_env(self, c.name, c.image), **container_env(
                self.pod, spec, self.agent.lookup, self.view.pod_ip, self.agent.node_ip, self.agent.allocatable
            )}
            argv = container_argv(spec, env)
            mounts = volumes.mounts(spec, self.volumes or {})
        except (ConfigError, volumes.VolumeError) as exc:
            c.state, c.reason, c.message = "waiting", "CreateContainerConfigError", str(exc)
            self._event_once("Warning", "Failed", f"Error: {exc}")
            self.next_start[c.name] = now + RETRY_S
            return
        # Shallow mount points first, so a mount below another one lands inside it.
        mounts.sort(key=lambda m: m["target"].count("/"))
        termination_log = self.dir / f"{c.name}.termination-log"
        termination_log.write_text("")  # each start gets an empty one, as kubelet does
        mounts += [
            {"source": str(self.hosts_path), "target": "/etc/hosts", "readOnly": False},
            {"source": str(self.dir / "resolv.conf"), "target": "/etc/resolv.conf", "readOnly": False},
            {"source": str(termination_log), "target": spec.get("terminationMessagePath") or TERMINATION_LOG,
             "readOnly": False},
        ]
        if c.name in self.pending_restart:
            self.pending_restart.discard(c.name)
            c.restart_count += 1
        logdir = self.dir / "logs" / c.name
        logdir.mkdir(parents=True, exist_ok=True)
        start_error = self.dir / f"{c.name}.start-error"
        start_error.unlink(missing_ok=True)
        cfg_path = self.dir / f"{c.name}.podinit.json"
        cfg_path.write_text(json.dumps({
            "netns": self.netns, "hostname": self.hostname, "mounts": mounts,
            **({"cwd": spec["workingDir"]} if spec.get("workingDir") else {"hostCwd": str(self.dir / "work")}),
            "argv": argv, "env": env,
            "startError": str(start_error), "hostPaths": volumes.host_paths(env),
        }))
        with open(logdir / f"{c.restart_count}.log", "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-S", PODINIT, str(cfg_path)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, cwd=self.dir,
            )
        self.procs[c.name], self.envs[c.name] = proc, env
        c.state, c.reason, c.message = "running", None, None
        c.started_at, c.pid, c.exit_code, c.signal = time.time(), proc.pid, None, None
        c.started, c.ready = "startupProbe" not in spec, False
        self.probers[c.name] = {
            kind: probes.Prober(spec[key], now)
            for kind, key in (("startup", "startupProbe"), ("liveness", "livenessProbe"), ("readiness", "readinessProbe"))
            if spec.get(key)
        }
        threading.Thread(target=self._reap, args=(proc,), daemon=True, name=f"reap-{proc.pid}").start()
        self.agent.event(self.pod, "Normal", "Started", f"Started container {c.name} (pid {proc.pid})")
        self._probe(c, now)

    def _reap(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self.wake.set()

    def _on_exit(self, c: Container, rc: int, now: float) -> None:
        proc = self.procs.pop(c.name)
        killpg(proc.pid, signal.SIGKILL)  # what is left of the container's processes goes with it
        self.agent.kill_marked(self, c.name)
        code, sig = exit_code_of(rc)
        start_error = self.dir / f"{c.name}.start-error"
        c.state, c.exit_code, c.signal, c.finished_at, c.ready = "terminated", code, sig, time.time(), False
        if start_error.exists():
            c.reason, c.message = "StartError", start_error.read_text()
        else:
            c.reason, c.message = ("Completed" if code == 0 else "Error"), self._termination_message(c, code)
        policy = self.view.restart_policy
        if c.init:
            restart = code != 0 and policy != "Never"
        else:
            restart = policy == "Always" or (policy == "OnFailure" and code != 0)
        if not restart:
            return
        ran = c.finished_at - (c.started_at or c.finished_at)
        base, cap = self.agent.backoff_base, self.agent.backoff_max
        delay = base if ran > 10 * cap else self.backoff.get(c.name, base)
        self.backoff[c.name] = min(delay * 2, cap)
        c.last_terminated = c.terminated_dict()
        c.state, c.reason = "waiting", "CrashLoopBackOff"
        c.message = f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}"
        self.next_start[c.name] = now + delay
        self.pending_restart.add(c.name)
        self.agent.event(self.pod, "Warning", "BackOff", c.message)

    def _termination_message(self, c: Container, code: int) -> str | None:
        """kubelet's rule: what the container wrote to its terminationMessagePath (at most 4096 bytes), else with
        terminationMessagePolicy FallbackToLogsOnError and a failure, the end of its log (80 lines, 2048 bytes)."""
        try:
            text = (self.dir / f"{c.name}.termination-log").read_bytes()[:MAX_TERMINATION_MESSAGE]
        except OSError:
            text = b""
        if not text.strip() and code != 0 and self.specs[c.name].get("terminationMessagePolicy") == "FallbackToLogsOnError":
            log = self.dir / "logs" / c.name / f"{c.restart_count}.log"
            try:
                text = b"\n".join(log.read_bytes().splitlines()[-80:])[-2048:]
            except OSError:
                text = b""
        return text.decode(errors="replace").strip() or None

    def _probe(self, c: Container, now: float) -> None:
        spec, probers = self.specs[c.name], self.probers.get(c.name, {})
        pid, env = c.pid, self.envs.get(c.name, {})

        def run(kind: str) -> bool | None:
            p = probers[kind]
            if not p.due(now):
                return None
            ok, msg = probes.run_once(p.probe, spec, self.view.pod_ip, pid, env)
            p.record(ok, msg, time.monotonic())
            if not ok:  # once per distinct message: kubelet folds repeats into one Event's count
                self._event_once("Warning", "Unhealthy", f"{kind.capitalize()} probe failed: {msg}")
            return ok

        if "startup" in probers and not c.started:
            if run("startup") and probers["startup"].success:
                c.started = True
            elif probers["startup"].failed:
                self._kill_container(c, "startup probe failed")
                return
            if not c.started:
                c.ready = False
                return
        if "liveness" in probers:
            run("liveness")
            if probers["liveness"].failed:
                self._kill_container(c, "liveness probe failed")
                return
        if "readiness" in probers:
            run("readiness")
            c.ready = probers["readiness"].success
        else:
            c.ready = True

    def _kill_container(self, c: Container, why: str) -> None:
        """Restart a container whose probe failed: SIGTERM, its terminationGracePeriodSeconds, SIGKILL."""
        proc = self.procs[c.name]
        grace = max(float(self.pod["spec"].get("terminationGracePeriodSeconds", 30)), MIN_GRACE_S)
        sent = time.time()
        killpg(proc.pid, signal.SIGTERM)
        self.agent.signal_log("SIGTERM", self, containers=[c.name], grace=grace, reason=why, at=sent)
        self.agent.event(self.pod, "Normal", "Killing", f"Container {c.name} {why}, will be restarted")
        try:
            proc.wait(timeout=max(0.0, sent + grace - time.time()))
        except subprocess.TimeoutExpired:
            sent = time.time()
            killpg(proc.pid, signal.SIGKILL)
            self.agent.signal_log("SIGKILL", self, containers=[c.name], reason=f"grace period {grace:g}s expired", at=sent)
            proc.wait()
        self._on_exit(c, proc.returncode, time.monotonic())

    def _next_due(self, now: float) -> float:
        due = [now + (STATUS_RETRY_S if self.status_unsent else 5.0)]
        if self.volumes is None:
            due.append(self.retry_at)
        for c in [*self.view.init, *self.view.main]:
            if c.state == "waiting":
                due.append(self.next_start.get(c.name, now))
            elif c.state == "running":
                due.extend(p.next_at for p in self.probers.get(c.name, {}).values())
        return max(0.02, min(due) - now)

    # ---- status ---------------------------------------------------------------------------------------------
    def _sync_status(self) -> None:
        status = pod_status(self.view, self.conditions, time.time())
        if status == self.last_status:
            self.status_unsent = False
            return
        try:
            self.agent.patch_status(self, status)
        except Exception as exc:  # noqa: BLE001 - like kubelet's status manager: keep the pod, send it again
            # Recording it as sent would leave the API's view stale forever (once seen: a pod shown Pending
            # while its process ran); raising would kill the pod's processes.
            log.warning("pod %s/%s: status not sent (%s); retrying", self.ns, self.pod_name, exc)
            self.status_unsent = True
            self.agent.write_pod_state(self)  # the processes' local view (pids, states) is true regardless
            return
        self.status_unsent = False
        self.conditions = status["conditions"]
        self.last_status = status
        self.agent.write_pod_state(self)

    # ---- termination ----------------------------------------------------------------------------------------
    def _terminate(self) -> None:
        with self._lock:
            deleted = self.deletion_seen
            requested = self.grace if deleted else None
            grace = requested if deleted else float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            if self.stop_grace is not None:
                grace = min(grace if grace is not None else self.stop_grace, self.stop_grace)
            grace = max(grace if grace is not None else 0.0, MIN_GRACE_S)
        running = {name: p for name, p in self.procs.items() if p.poll() is None}
        self.agent.signal_log("deletion", self, containers=sorted(running), grace=requested,
                              reason="node agent stopping" if self.stop_grace is not None else "pod deleted",
                              at=self.deletion_seen_at, rv=self.deletion_rv)
        if running:
            sent = time.time()
            t0 = time.monotonic()
            for proc in running.values():
                killpg(proc.pid, signal.SIGTERM)
            self.agent.signal_log("SIGTERM", self, containers=sorted(running), grace=grace, at=sent)
            self.agent.event(self.pod, "Normal", "Killing",
                             f"Stopping containers {sorted(running)} (grace period {grace:g}s)")
            deadline = t0 + grace
            while any(p.poll() is None for p in running.values()):
                now = time.monotonic()
                with self._lock:
                    if self.grace is not None and self.grace < grace:  # a second delete with a shorter grace
                        deadline = min(deadline, t0 + max(self.grace, MIN_GRACE_S))
                    if self.gone and self.gone_at is not None:  # force-deleted meanwhile: the minimum at most
                        deadline = min(deadline, max(self.gone_at, t0) + MIN_GRACE_S)
                if now >= deadline:
                    break
                self.wake.wait(min(0.05, deadline - now))
                self.wake.clear()
            stuck = sorted(name for name, p in running.items() if p.poll() is None)
            if stuck:
                waited, sent = time.monotonic() - t0, time.time()
                for name in stuck:
                    killpg(running[name].pid, signal.SIGKILL)
                self.agent.signal_log("SIGKILL", self, containers=stuck, at=sent,
                                      reason=f"still running {waited:.2f}s after SIGTERM (grace {grace:g}s)")
            for proc in running.values():
                proc.wait()
        for name, proc in list(self.procs.items()):
            c = next(c for c in [*self.view.init, *self.view.main] if c.name == name)
            self._on_exit_final(c, proc)
        self.agent.kill_marked(self)
        self._release_network()
        self.agent.write_pod_state(self)
        # Logged before the API object goes, so whoever sees the pod gone finds the entry already written.
        self.agent.signal_log("removed", self, containers=[])
        if not self.gone:
            self.agent.delete_pod_now(self)

    def _on_exit_final(self, c: Container, proc: subprocess.Popen) -> None:
        killpg(proc.pid, signal.SIGKILL)
        code, sig = exit_code_of(proc.wait())
        c.state, c.exit_code, c.signal, c.finished_at, c.ready = "terminated", code, sig, time.time(), False
        c.reason = "Completed" if code == 0 else "Error"
        self.procs.pop(c.name, None)


def _rv(meta: dict) -> int | None:
    """A pod's resourceVersion as a number (etcd's revision: the API server's write order), None if not one."""
    try:
        return int(meta.get("resourceVersion") or "")
    except ValueError:
        return None
