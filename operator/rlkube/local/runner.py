"""`rlkube local FILE`: run one TrainingJob on this machine as local processes.

The same roles as in a cluster (`python -m rlkube.core.<role>` with the env of rlkube.core.runtime), started in
the design's order (Redis; trainer and inference together; preprocessor; actors once inference is healthy),
followed through the trainer's events in Redis, and torn down in the operator's order: actors, preprocessor,
inference, trainer, Redis. Any ending (success, a crashed role, Ctrl-C) goes through that teardown.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rlkube.api import SpecError, TrainingJobSpec, parse_manifest
from rlkube.api.spec import TEARDOWN_ORDER
from rlkube.core import protocol, runtime
from rlkube.local.outcome import Observation, Outcome, decide
from rlkube.local.processes import RoleProcess, python_module, stop_all
from rlkube.local.redis_server import RedisNotInstalled, RedisServer

NAMESPACE = "local"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    name: str
    phase: str
    reason: str
    message: str
    steps: int
    max_steps: int
    metrics: list[dict[str, Any]]
    teardown: list[str]
    forced: list[str]
    wall_seconds: float
    output_dir: Path
    checkpoint: str | None = None
    events: dict[str, int] = field(default_factory=dict)

    def reward_window(self, first: bool, n: int = 10) -> float | None:
        rewards = [m["reward_mean"] for m in self.metrics if isinstance(m.get("reward_mean"), int | float)]
        window = rewards[:n] if first else rewards[-n:]
        return sum(window) / len(window) if window else None

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "phase": self.phase,
            "reason": self.reason,
            "message": self.message,
            "steps": self.steps,
            "max_steps": self.max_steps,
            "reward_first": self.reward_window(first=True),
            "reward_last": self.reward_window(first=False),
            "teardown": self.teardown,
            "forced": self.forced,
            "checkpoint": self.checkpoint,
            "wall_seconds": round(self.wall_seconds, 2),
            "output_dir": str(self.output_dir),
        }


class LocalJob:
    def __init__(self, name: str, spec: TrainingJobSpec, raw_spec: dict, output_dir: Path, console: Console):
        self.name = name
        self.spec = spec
        self.raw_spec = raw_spec
        self.out = output_dir
        self.console = console
        self.redis_server: RedisServer | None = None
        self.procs: dict[str, list[RoleProcess]] = {r: [] for r in ("trainer", "inference", "preprocessor", "actor")}
        self.keys = protocol.StreamKeys.for_job(NAMESPACE, name, spec.trainer.backend)
        self.metrics: list[dict[str, Any]] = []
        self.teardown: list[str] = []
        self.forced: list[str] = []
        self.step = 0
        self.version = 0
        self.finished: protocol.TrainerEvent | None = None
        self.finished_at: float | None = None
        self.trainer_exit_at: float | None = None
        self.last_event_at = time.monotonic()
        self.events_seen: dict[str, int] = {}
        self._interrupted = False

    # --- start -------------------------------------------------------------------------------------

    def _env(self, role: str, index: int, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            {
                runtime.ENV_CONFIG: str(self.config_path),
                runtime.ENV_REDIS_URL: self.redis_server.url,
                runtime.ENV_INDEX: str(index),
                runtime.ENV_BIND_HOST: "127.0.0.1",
                runtime.ENV_INFERENCE_URLS: ",".join(self.inference_urls),
                runtime.ENV_WEIGHT_SYNC: f"127.0.0.1:{self.weight_sync_port}",
                runtime.ENV_OUTPUT_DIR: str(self.out),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(extra)
        return env

    def _spawn(self, role: str, index: int, **extra: str) -> RoleProcess:
        proc = RoleProcess(
            role=role,
            index=index,
            argv=python_module(f"rlkube.core.{role}"),
            env=self._env(role, index, **extra),
            log_path=self.out / "logs" / f"{role}-{index}.log",
        ).start()
        self.procs[role].append(proc)
        return proc

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.redis_server = RedisServer(self.out / "redis").start()
        self.redis = self.redis_server.client()
        self.config_path = runtime.write_job_config(self.out / "job.json", NAMESPACE, self.name, self.raw_spec)
        # Where to attach while the job runs (redis-cli, tests): the events stream key and the server's URL.
        (self.out / "run.json").write_text(
            json.dumps({"pid": os.getpid(), "redis_url": self.redis_server.url, "events": self.keys.events})
        )
        self.weight_sync_port = _free_port()
        ports = [_free_port() for _ in range(self.spec.inference.replicas)]
        self.inference_urls = [f"http://127.0.0.1:{p}" for p in ports]
        # Trainer and inference start together: the trainer must not wait for inference health (seed 6.6).
        # One trainer process per spec.trainer.nodes, with the torchrun env the operator gives each trainer pod.
        nodes = self.spec.trainer.nodes
        master_port = str(_free_port())
        for rank in range(nodes):
            dist_env = {"RANK": str(rank), "WORLD_SIZE": str(nodes), "NODE_RANK": str(rank), "NNODES": str(nodes),
                        "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master_port}
            self._spawn("trainer", rank, **{runtime.ENV_CHECKPOINT_DIR: str(self.out / "checkpoints")}, **dist_env)
        for i, port in enumerate(ports):
            self._spawn("inference", i, **{runtime.ENV_PORT: str(port)})
        for i in range(self.spec.preprocessor.replicas):
            self._spawn("preprocessor", i)

    def _inference_healthy(self) -> bool:
        for url in self.inference_urls:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status != 200:
                        return False
            except OSError:
                return False
        return True

    # --- follow ------------------------------------------------------------------------------------

    def _read_events(self, last_id: str, block_ms: int) -> str:
        try:
            got = self.redis.xread({self.keys.events: last_id}, block=block_ms, count=100)
        except redis.RedisError as exc:
            raise RuntimeError(f"lost the job's Redis: {exc}") from exc
        for _, entries in got or []:
            for sid, fields in entries:
                last_id = sid.decode() if isinstance(sid, bytes) else sid
                event = protocol.decode_event(sid, fields)
                if event is None:
                    continue
                self.last_event_at = time.monotonic()
                self.events_seen[event.type] = self.events_seen.get(event.type, 0) + 1
                if event.step is not None:
                    self.step = max(self.step, event.step)
                if event.type == protocol.WEIGHTS_READY:
                    self.version = int(event.payload.get("version", event.payload.get("step", self.version)))
                elif event.type == protocol.METRICS:
                    # The stream id's millisecond clock times steps without trusting the pods' clocks.
                    self.metrics.append({**event.payload, "_t": int(last_id.split("-")[0]) / 1000})
                elif event.type == protocol.TRAINING_FINISHED and self.finished is None:
                    self.finished, self.finished_at = event, time.monotonic()
        return last_id

    def _crashed(self) -> tuple[str, int] | None:
        # Trainer ranks other than 0 (rank 0's exit is the trainer's outcome): a failed one fails the job.
        for p in self.procs["trainer"][1:]:
            code = p.returncode()
            if code is not None and code != 0:
                return p.name, code
        for role in ("inference", "preprocessor", "actor"):
            for p in self.procs[role]:
                code = p.returncode()
                # Producers stop on training_finished; exiting before it is a failure too.
                if code is not None and (code != 0 or self.finished is None):
                    return p.name, code
        return None

    def _observe(self) -> Observation:
        trainer = self.procs["trainer"][0]
        code = trainer.returncode()
        if code is not None and self.trainer_exit_at is None:
            self.trainer_exit_at = time.monotonic()
        payload = self.finished.payload if self.finished else {}
        rp = self.spec.run_policy
        return Observation(
            now=time.monotonic(),
            max_steps=self.spec.algorithm.max_steps,
            completion_timeout=rp.completion_timeout_seconds,
            event_timeout=rp.event_timeout_seconds,
            last_event_at=self.last_event_at,
            finished_at=self.finished_at,
            finished_step=self.finished.step if self.finished else None,
            finished_checkpoint=payload.get("checkpoint"),
            finished_interrupted=bool(payload.get("interrupted", False)),
            trainer_exit=code,
            trainer_exit_at=self.trainer_exit_at,
            crashed=self._crashed(),
            interrupted_by_user=self._interrupted,
        )

    def follow(self) -> Outcome:
        max_steps = self.spec.algorithm.max_steps
        actors_started = False
        last_id = "0-0"
        columns = [
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task(self.name, total=max_steps, info="starting roles")
            while True:
                if not actors_started and self._inference_healthy():
                    for i in range(self.spec.actor.replicas):
                        self._spawn("actor", i)
                    actors_started = True
                last_id = self._read_events(last_id, block_ms=500)
                bar.update(task, completed=self.step, info=self._info(actors_started))
                outcome = decide(self._observe())
                if outcome is not None:
                    bar.update(task, info=f"{outcome.phase}: {outcome.reason}")
                    return outcome

    def _info(self, actors_started: bool) -> str:
        if not self.metrics:
            return "waiting for inference" if not actors_started else "waiting for the first step"
        m = self.metrics[-1]
        parts = [f"reward {m.get('reward_mean', math.nan):.3f}"]
        if "lag_max" in m:
            parts.append(f"lag {m['lag_max']}")
        if "tokens_per_s" in m:
            parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        errors = sum(int(x.get("reward_errors") or 0) for x in self.metrics)
        if errors:
            parts.append(f"{errors} reward errors")  # samples whose reward function failed (scored 0)
        return "  ".join(parts)

    def interrupt(self, *_: Any) -> None:
        self._interrupted = True

    # --- teardown ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ordered teardown: actors, preprocessor, inference, trainer, Redis; each stage waited for."""
        grace = self.spec.teardown.grace_period_seconds
        for role in TEARDOWN_ORDER:
            if role == "redis":
                if self.redis_server is not None:
                    self.redis_server.stop(timeout=grace.redis)
                    self.teardown.append("redis")
                continue
            procs = self.procs.get(role, [])
            if not procs:
                continue
            stop_all(procs, grace_seconds=getattr(grace, role))
            self.forced += [p.name for p in procs if p.forced]
            self.teardown.append(role)


def _plot(metrics: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    points = [(m["step"], m["reward_mean"]) for m in metrics if "step" in m and "reward_mean" in m]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_local(manifest: dict, output_dir: Path | None = None, console: Console | None = None) -> RunResult:
    """Run a TrainingJob manifest to the end; raises SpecError for a bad manifest, before starting anything."""
    meta, spec = parse_manifest(manifest)
    name = meta["name"]
    console = console or Console(stderr=True)
    out = Path(output_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    job = LocalJob(name, spec, manifest["spec"], out, console)
    t0 = time.monotonic()
    previous = {sig: signal.signal(sig, job.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            job.start()
            outcome = job.follow()
        except (RuntimeError, OSError) as exc:
            outcome = Outcome("Failed", "RunnerError", str(exc))
        finally:
            job.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    payload = job.finished.payload if job.finished else {}
    result = RunResult(
        name=name,
        phase=outcome.phase,
        reason=outcome.reason,
        message=outcome.message,
        steps=job.step,
        max_steps=spec.algorithm.max_steps,
        metrics=job.metrics,
        teardown=job.teardown,
        forced=job.forced,
        wall_seconds=time.monotonic() - t0,
        output_dir=out,
        checkpoint=payload.get("checkpoint"),
        events=job.events_seen,
    )
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in job.metrics))
    _plot(job.metrics, out / "reward.png", f"{name}: {spec.algorithm.loss} on {spec.task.name}")
    if outcome.phase != "Succeeded":
        for procs in job.procs.values():
            for p in procs:
                if p.returncode() not in (0, None) or outcome.reason in ("ComponentFailed", "TrainerFailed"):
                    console.print(f"[red]--- last lines of {p.name} ({p.log_path}) ---[/red]\n{p.log_tail()}")
    return result



def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"

def cli(args) -> int:
    console = Console(stderr=True)
    try:
        with open(args.file) as fh:
            manifest = yaml.safe_load(fh)
        result = run_local(manifest, Path(args.output_dir) if args.output_dir else None, console)
    except SpecError as exc:
        for err in exc.errors:
            console.print(f"[red]{args.file}: {err}[/red]")
        return 2
    except (RedisNotInstalled, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    s = result.summary()
    color = "green" if result.phase == "Succeeded" else "red"
    console.print(
        f"[{color}]{result.phase}[/{color}] ({result.reason}: {result.message}); steps {s['steps']}/{s['max_steps']}; "
        f"reward first-10 {_fmt(s['reward_first'])}, last-10 {_fmt(s['reward_last'])}; "
        f"teardown {' -> '.join(s['teardown'])}; "
        f"{s['wall_seconds']}s; output {s['output_dir']}"
    )
    if args.json:
        sys.stdout.write(json.dumps(s) + "\n")
    if result.phase == "Succeeded":
        return 0
    return 130 if result.reason == "Interrupted" else 1
