"""`make demo-cluster`: examples/tiny-cpu.yaml on a real control plane, with pods that really run.

Starts (building it once if needed) the cached kube-apiserver + etcd + kube-controller-manager, the test node
agent, installs the CRD, runs `rlkube operator`, applies the example, follows it live (phase, step, reward,
pods) until it finishes, prints the outcome and the teardown order as the node agent saw it, then stops
everything it started and checks that no process is left.

    python tests/support/demo_cluster.py [--manifest FILE] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # tests/: support, nodeagent, cluster

import urllib3
import yaml
from cluster.control_plane import ControlPlane
from support.clusterjob import EXAMPLE, ClusterJob, OperatorProcess, stage_names
from kubernetes import client, config
from kubernetes.client.rest import ApiException
from nodeagent.harness import AgentProcess, wait_for
from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rlkube.api.crd import crd as make_crd

NAMESPACE = "rlkube-demo"
console = Console()


def install_crd(api: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api)
    body = make_crd()
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as exc:
        if exc.status != 409:
            raise
    name = body["metadata"]["name"]

    def established():
        conds = ext.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conds)

    wait_for(established, 60, f"CRD {name} Established")
    custom = client.CustomObjectsApi(api)
    wait_for(lambda: _lists(custom), 30, "TrainingJobs served")


def _lists(custom: client.CustomObjectsApi) -> bool:
    try:
        custom.list_cluster_custom_object("rlkube.io", "v1alpha1", "trainingjobs")
        return True
    except ApiException:
        return False


def pods_table(job: ClusterJob) -> Table:
    table = Table(title=f"pods in {job.namespace} (run by node {job.agent.node_name})", expand=False)
    for col in ("pod", "phase", "ready", "restarts", "IP"):
        table.add_column(col)
    for p in sorted(job.core.list_namespaced_pod(job.namespace).items, key=lambda p: p.metadata.name):
        cs = (p.status.container_statuses or [None])[0]
        phase = "Terminating" if p.metadata.deletion_timestamp else p.status.phase
        table.add_row(p.metadata.name, phase, "yes" if cs and cs.ready else "no",
                      str(cs.restart_count if cs else 0), p.status.pod_ip or "")
    return table


def follow(job: ClusterJob, max_steps: int, timeout: float) -> dict:
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("training", total=max_steps, info="")
    deadline = time.monotonic() + timeout
    with Live(console=console, refresh_per_second=4) as live:
        while True:
            tj = job.get() or {}
            st = tj.get("status") or {}
            step = max(job.follower.step if job.follower else 0, int((st.get("trainer") or {}).get("step") or 0))
            rewards = job.follower.rewards() if job.follower else []
            info = f"phase {st.get('phase', '-')}" + (f", reward {rewards[-1]:.3f}" if rewards else "")
            if (st.get("teardown") or {}).get("stage"):
                info += f", teardown: {st['teardown']['stage']}"
            progress.update(task, completed=step, info=info)
            live.update(Group(progress, pods_table(job)))
            if st.get("phase") in ("Succeeded", "Failed"):
                return tj
            if job.follower is None and any(p.metadata.name.endswith("-redis") and p.status.pod_ip
                                            for p in job.core.list_namespaced_pod(job.namespace).items):
                try:
                    job.follow(timeout=5)
                except TimeoutError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish within {timeout:.0f}s\n{job.diagnostics()}")
            time.sleep(0.5)


def report(job: ClusterJob, tj: dict, wall: float) -> bool:
    st = tj["status"]
    ok = st["phase"] == "Succeeded"
    color = "green" if ok else "red"
    console.print(f"\n[bold {color}]{job.name}: {st['phase']}[/] ({st.get('reason')}: {st.get('message')}) in {wall:.0f}s")
    rewards = job.follower.rewards() if job.follower else []
    if len(rewards) >= 20:
        console.print(f"reward: first-10 mean {sum(rewards[:10]) / 10:.3f} -> last-10 mean {sum(rewards[-10:]) / 10:.3f}")
    console.print(f"operator's teardown stages: {' -> '.join(stage_names(st))}")
    table = Table(title="teardown as the node agent saw it (signals.jsonl)")
    for col in ("t (s)", "pod", "role", "event", "containers"):
        table.add_column(col)
    signals = job.agent_signals()
    t0 = signals[0]["time"] if signals else 0
    for s in signals:
        if s["event"] == "deletion" and not s["containers"]:
            table.add_row(f"{s['time'] - t0:6.2f}", s["pod"], s["role"] or "", "deletion", "(had already exited)")
        elif s["event"] != "removed":
            table.add_row(f"{s['time'] - t0:6.2f}", s["pod"], s["role"] or "", s["event"], ",".join(s["containers"]))
    console.print(table)
    console.print(f"deletion order: {' -> '.join(job.order('deletion'))}")
    return ok


def main() -> int:
    urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)  # the local API server is self-signed
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=EXAMPLE)
    parser.add_argument("--workdir", type=Path, default=None, help="logs of every component (default: a temp dir)")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rlkube-demo-cluster-"))
    workdir.mkdir(parents=True, exist_ok=True)
    manifest = yaml.safe_load(args.manifest.read_text())
    max_steps = manifest["spec"]["algorithm"]["maxSteps"]
    console.print(f"[bold]rlkube demo-cluster[/]: {args.manifest} on a local control plane; logs in {workdir}")

    cp = agent = operator = job = None
    ok = False
    try:
        with console.status("starting etcd + kube-apiserver + kube-controller-manager"):
            cp = ControlPlane(workdir / "control-plane").start()
        api = config.new_client_from_config(config_file=str(cp.kubeconfig))
        with console.status("starting the node agent, installing the CRD"):
            agent = AgentProcess(cp.kubeconfig, workdir / "node-agent", namespace_selector=None,
                                 namespaces=(NAMESPACE,)).start()
            install_crd(api)
            client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
        console.print(f"node {agent.node_name}: pods get addresses in {agent.info['subnet']}")
        operator = OperatorProcess(cp.kubeconfig, NAMESPACE, workdir / "operator.log").start()
        job = ClusterJob(api, agent, NAMESPACE)
        t0 = time.monotonic()
        job.apply(manifest)
        tj = follow(job, max_steps, args.timeout)
        ok = report(job, tj, time.monotonic() - t0)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping everything[/]")
    finally:
        with console.status("stopping the operator, the node agent and the control plane"):
            if job is not None:
                job.recorder.stop()
                if job.follower is not None:
                    job.follower.stop()
            if operator is not None:
                operator.stop()
            left = []
            if agent is not None:
                agent.stop()
                left = [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in agent.live_processes()]
            if cp is not None:
                servers = dict(cp.procs)
                cp.stop()
                left += [f"{n} {p.pid}" for n, p in servers.items() if p.poll() is None]
            if operator is not None and operator.alive():
                left.append(f"operator {operator.proc.pid}")
        if left:
            console.print(f"[red]processes left behind: {left}[/]")
            ok = False
        else:
            console.print("stopped everything it started: no process left")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
