"""`rlkube local FILE`: run one TrainingJob on this machine as local processes.

The same roles as in a cluster (`python -m rlkube.core.<role>` with the env of rlkube.contract.runtime), started in
the order of docs/design.md §3 (Redis; trainer and inference together; preprocessor; actors once inference is healthy),
followed through the trainer's events in Redis, and torn down in the operator's order: actors, preprocessor,
inference, trainer, Redis. Any ending (success, a crashed role, Ctrl-C) goes through that teardown.

Before anything starts, spec.model.path is materialized once into the model cache (what the operator's init
container does in a cluster): an hf:// model is downloaded there, builtin:// written there, a directory checked.
Every role gets RLKUBE_MODEL_CACHE pointing at it and HF_HUB_OFFLINE=1, so the roles reuse that copy instead of
each fetching its own. A model that cannot work fails the job there, judged like a role's config error.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import redis
import yaml
from rich.console import Console

from rlkube.api import TrainingJobSpec
from rlkube.api.role import Role
from rlkube.contract import counters, protocol, runtime, streams
from rlkube.core.hf import ModelError
from rlkube.core.hf.fetch import fetch
from rlkube.core.hf.source import default_cache_dir
from rlkube.lifecycle import progress, roles, tracker_failures
from rlkube.lifecycle.environment import Addresses, role_env, role_module
from rlkube.lifecycle.evidence import Evidence, Failure, Finished
from rlkube.lifecycle.judgement import judge
from rlkube.lifecycle.phases import ConditionStatus, Phase, Reason
from rlkube.lifecycle.validation import SpecError, importable_errors, parse_manifest
from rlkube.lifecycle.verdict import Outcome, Verdict
from rlkube.local.plot import plot_rewards
from rlkube.local.ports import free_port
from rlkube.local.processes import RoleProcess, python_module, stop_all
from rlkube.local.redis_server import RedisNotInstalled, RedisServer
from rlkube.local.terminal import progress_bar, status_line, summary_line

NAMESPACE = "local"
MODEL_FETCH = ("init", "model-fetch")
"""(role, name) that a model that cannot be materialized is reported under: the step before any role, as the model
init container is in a cluster."""


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
    restarts: dict[str, int] = field(default_factory=dict)
    stalled: bool = False
    invalid: list[str] = field(default_factory=list)
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    """Every `evaluation` event's payload (spec.evaluation), in stream order."""
    conditions: list[dict[str, str]] = field(default_factory=list)
    """Conditions a TrainingJob would carry besides its outcome: TrackerFailed (lifecycle/tracker_failures.py)."""
    agent: dict[str, int | float] | None = None
    """The agent counters a TrainingJob's status.agent would show (lifecycle.progress.fold_agent); None without an
    environment."""
    updates: list[dict[str, Any]] = field(default_factory=list)
    """Every weights_ready event's version and checksum, in stream order (what the engines must serve)."""

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
            # spec.evaluation: the held-out set's mean reward per evaluated weight version, first and last.
            "eval_versions": [e["version"] for e in self.evaluations],
            "eval_reward_first": self.evaluations[0]["reward_mean"] if self.evaluations else None,
            "eval_reward_last": self.evaluations[-1]["reward_mean"] if self.evaluations else None,
            # the last evaluation's counts as status.trainer shows them (rlkube.contract.counters.EVALUATION_STATUS)
            "eval_last": counters.evaluation_status(self.evaluations[-1]) if self.evaluations else None,
            "agent": self.agent,
            "teardown": self.teardown,
            "forced": self.forced,
            "checkpoint": self.checkpoint,
            "restarts": self.restarts,
            "stalled": self.stalled,
            "conditions": self.conditions,
            "wall_seconds": round(self.wall_seconds, 2),
            "output_dir": str(self.output_dir),
        }


class LocalJob:
    def __init__(self, name: str, spec: TrainingJobSpec, raw_spec: dict, output_dir: Path, console: Console,
                 model_cache: Path | None = None):
        self.name = name
        self.model_cache = model_cache
        self.spec = spec
        self.raw_spec = raw_spec
        self.out = output_dir
        self.console = console
        self.redis_server: RedisServer | None = None
        self.procs: dict[str, list[RoleProcess]] = {r: [] for r in roles.CORE_ROLES}
        self.keys = protocol.StreamKeys.for_job(NAMESPACE, name, spec.trainer.backend)
        self.metrics: list[dict[str, Any]] = []
        self.evaluations: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []
        self.agent: dict[str, int | float] | None = None
        self.teardown: list[str] = []
        self.forced: list[str] = []
        self.step = 0
        self.version = 0
        self.last_checkpoint: str | None = None
        """The newest checkpoint a checkpoint_saved/training_finished event named: a restarted trainer must find it."""
        self.finished: protocol.TrainerEvent | None = None
        self.finished_at: datetime | None = None
        self.trainer_started_at = _now()
        self.trainer_exited_at: datetime | None = None
        self.running_since: datetime | None = None
        self.last_event_at: datetime | None = None
        self.restarts: dict[str, int] = {r: 0 for r in roles.CORE_ROLES}
        self.failures: dict[str, Failure] = {}
        self.stalled = False
        self.events_seen: dict[str, int] = {}
        self.tracker_failed: str | None = None
        """The TrackerFailed condition's message: every tracker the trainer reported failed, once each."""
        self._interrupted = False

    # --- start -------------------------------------------------------------------------------------

    def _env(self, role: str, index: int) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        resume = self.last_checkpoint if role == Role.TRAINER else None  # None at the first start
        env.update(role_env(self.spec, role, index, self.addresses, resume))
        env[runtime.ENV_TERMINATION_LOG] = str(self._termination_log(role, index))
        if self.model_cache is not None:  # materialized before launch: every role reuses that copy, offline
            env[runtime.ENV_MODEL_CACHE] = str(self.model_cache)
            env["HF_HUB_OFFLINE"] = "1"
        return env

    def _termination_log(self, role: str, index: int) -> Path:
        return self.out / "logs" / f"{role}-{index}.termination-log"

    def _spawn(self, role: str, index: int) -> RoleProcess:
        self._termination_log(role, index).unlink(missing_ok=True)
        proc = RoleProcess(
            role=role,
            index=index,
            argv=python_module(role_module(self.spec, role)),
            env=self._env(role, index),
            log_path=self.out / "logs" / f"{role}-{index}.log",
        ).start()
        procs = self.procs[role]
        if index < len(procs):
            procs[index] = proc
        else:
            procs.append(proc)
        if role == Role.TRAINER and index == 0:
            self.trainer_started_at = _now()
        return proc

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.redis_server = RedisServer(self.out / "redis").start()
        self.redis = self.redis_server.client()
        self.events = streams.EventReader(self.redis, self.keys.events)
        # The run's uid, as a cluster gives each TrainingJob one: a run into an output directory an earlier run used
        # keeps its own samples (docs/design.md §5.7); the trainer restarted within this run reads the same file.
        config_path = runtime.write_job_config(self.out / "job.json", NAMESPACE, self.name, self.raw_spec,
                                               uid=str(uuid.uuid4()))
        # Where to attach while the job runs (redis-cli, tests): the events stream key and the server's URL.
        (self.out / "run.json").write_text(
            json.dumps({"pid": os.getpid(), "redis_url": self.redis_server.url, "events": self.keys.events})
        )
        ports = tuple(free_port() for _ in range(self.spec.inference.replicas))
        self.addresses = Addresses(
            config_path=str(config_path),
            redis_url=self.redis_server.url,
            bind_host="127.0.0.1",
            inference_urls=tuple(f"http://127.0.0.1:{p}" for p in ports),
            inference_ports=ports,
            weight_sync_host="127.0.0.1",
            weight_sync_port=free_port(),
            master_port=free_port(),
            checkpoint_dir=str(self.out / "checkpoints"),
            output_dir=str(self.out),
        )
        self._start_gated()

    def _start_gated(self) -> None:
        """Start every role whose gate is open (docs/design.md §3; actors once every inference server is healthy)."""
        exist = {r: len(self.procs.get(r, [])) for r in roles.START_ORDER}
        exist[Role.REDIS] = ready_redis = 1 if self.redis_server is not None else 0
        ready = {Role.REDIS: ready_redis}
        # No sandbox pods here: with spec.sandbox.mode `pods` the actors still run each snippet as a child of their
        # own process (rlkube.core.actor.sandbox, which logs the layers it has), so that gate is open.
        exist[Role.SANDBOX] = ready[Role.SANDBOX] = roles.replicas(self.spec, Role.SANDBOX)
        if exist[Role.INFERENCE] and not exist[Role.ACTOR]:
            ready[Role.INFERENCE] = self._healthy_inference()
        if roles.colocated(self.spec) and exist[Role.TRAINER] and not exist[Role.ACTOR]:
            ready[Role.TRAINER] = self._healthy_inference()  # the trainer's own engine (rlkube.core.launch.colocated)
        for role in roles.CORE_ROLES:
            if exist[role] or not roles.may_start(self.spec, role, roles.StartState(exist, ready)):
                continue
            for i in range(roles.replicas(self.spec, role)):
                self._spawn(role, i)
            exist[role] = roles.replicas(self.spec, role)

    def _healthy_inference(self) -> int:
        healthy = 0
        for url in self.addresses.inference_urls:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    healthy += resp.status == 200
            except OSError:
                pass
        return healthy

    # --- follow ------------------------------------------------------------------------------------

    def _read_events(self, block_ms: int) -> None:
        try:
            events = self.events.read(block_ms=block_ms)
        except redis.RedisError as exc:  # the job's own Redis is gone: nothing can go on
            raise RuntimeError(f"lost the job's Redis: {exc}") from exc
        for event in events:
            self._ingest(event)

    def _ingest(self, event: protocol.TrainerEvent) -> None:
        self.events_seen[event.type] = self.events_seen.get(event.type, 0) + 1
        facts = progress.read(event)
        if facts.from_trainer:  # an actor's evaluation says nothing of the trainer being alive (the stall rule)
            self.last_event_at = _now()
        if facts.evaluation is not None:
            # The payload whole (full precision; the status rounds to 4 decimals), as the metrics events are kept.
            self.evaluations.append({**(facts.evaluation_payload or {}), "version": facts.evaluation[0],
                                     "_t": event.time})
        if facts.step is not None:
            self.step = max(self.step, facts.step)
        if facts.weights_version is not None:
            self.version = facts.weights_version
            self.updates.append({"version": facts.weights_version, "checksum": event.payload.get("checksum")})
        if facts.checkpoint is not None:
            self.last_checkpoint = facts.checkpoint[1]
        if facts.tracker_failure is not None:
            merged = tracker_failures.merged(self.tracker_failed, *facts.tracker_failure)
            if merged is not None:
                self.tracker_failed = merged
                self.console.print(f"{tracker_failures.line(*facts.tracker_failure)} (training goes on)",
                                   style="yellow", soft_wrap=True, markup=False)
        self.agent = progress.fold_agent(self.agent, facts.agent)
        if facts.metrics is not None:
            # The stream id's millisecond clock times steps without trusting the roles' clocks.
            self.metrics.append({**facts.metrics, "_t": event.time})
        if facts.finished:
            # An event of a trainer incarnation that has since been restarted is no evidence (as in the operator).
            sent = datetime.fromtimestamp(event.time, timezone.utc)
            if sent >= self.trainer_started_at - timedelta(seconds=1) and self.finished is None:
                self.finished, self.finished_at = event, _now()

    def _failed_processes(self) -> list[tuple[RoleProcess, int]]:
        """Processes that ended when they should not have (observed BEFORE the events are read, so a producer's
        exit 0 on training_finished is matched against a read made after it)."""
        out = []
        for role, procs in self.procs.items():
            for i, p in enumerate(procs):
                code = p.returncode()
                if code is None or p.extra.get("judged"):
                    continue
                if role == Role.TRAINER and i == 0 and code == 0:
                    if self.trainer_exited_at is None:
                        self.trainer_exited_at = _now()
                    continue
                if code != 0 or role != Role.TRAINER:
                    out.append((p, code))
        return out

    def _failure(self, p: RoleProcess, code: int) -> Failure:
        try:
            message = self._termination_log(p.role, p.index).read_text().strip()
        except FileNotFoundError:
            message = ""
        return Failure(p.role, p.name, code, message)

    def _evidence(self, failing: list[tuple[RoleProcess, int]]) -> Evidence:
        restarts = dict(self.restarts)
        failures = dict(self.failures)
        config = None
        for p, code in failing:
            f = self._failure(p, code)
            if code == runtime.EXIT_CONFIG:
                config = f
            failures[p.role] = f
        # One trainer failure restarts every rank together: count it once.
        for role in {p.role for p, _ in failing}:
            restarts[role] += 1 if role == Role.TRAINER else sum(p.role == role for p, _ in failing)
        finished = None
        if self.finished is not None and self.finished_at is not None:
            facts = progress.read(self.finished)
            finished = Finished(
                read_at=self.finished_at,
                step=facts.step,
                checkpoint=facts.checkpoint[1] if facts.checkpoint else None,
                interrupted=facts.interrupted,
            )
        refs = [self.last_event_at, self.running_since, self.trainer_started_at]
        return Evidence(
            now=_now(),
            config_error=config,
            restarts=restarts,
            failures=failures,
            finished=finished,
            trainer_exited_at=self.trainer_exited_at,
            running=self.running_since is not None,
            last_activity=max((r for r in refs if r is not None), default=None),
        )

    def verdict(self, failing: list[tuple[RoleProcess, int]]) -> Verdict:
        """The lifecycle's judgement of what this job has seen, with `failing` about to be restarted."""
        return judge(self._evidence(failing), self.spec)

    def _restart(self, failing: list[tuple[RoleProcess, int]]) -> None:
        """Replace what failed, as the operator replaces pods: a trainer failure restarts every rank (they resume
        from the checkpoint together), any other process alone."""
        for p, code in failing:
            self.failures[p.role] = self._failure(p, code)
            p.extra["judged"] = True
        if any(p.role == Role.TRAINER for p, _ in failing):
            self.restarts[Role.TRAINER] += 1
            ranks = self.procs[Role.TRAINER]
            for p in ranks:  # SIGKILL: a SIGTERMed rank would publish an interrupted training_finished
                if p.alive():
                    p.signal_group(signal.SIGKILL)
                    p.proc.wait()
            self.finished = self.finished_at = self.trainer_exited_at = None
            ckpt = self.out / "checkpoints"
            self.console.print(
                f"[yellow]trainer failed ({self.failures[Role.TRAINER].describe()}); restart "
                f"{self.restarts[Role.TRAINER]} of {self.spec.run_policy.backoff_limit}, resuming from {ckpt}[/yellow]"
            )
            for rank in range(len(ranks)):
                self._spawn(Role.TRAINER, rank)
        for p, _ in failing:
            if p.role == Role.TRAINER:
                continue
            self.restarts[p.role] += 1
            self.console.print(f"[yellow]{self.failures[p.role].describe()}; restarting it[/yellow]")
            self._spawn(p.role, p.index)

    def follow(self) -> Outcome:
        max_steps = self.spec.algorithm.max_steps
        with progress_bar(self.console) as bar:
            task = bar.add_task(self.name, total=max_steps, info="starting roles")
            while True:
                if self._interrupted:
                    return Outcome.failed(Reason.INTERRUPTED, "stopped by the user (SIGINT/SIGTERM)")
                if not self.procs[Role.ACTOR]:
                    self._start_gated()
                if self.running_since is None and (self.procs[Role.ACTOR] or self.last_event_at):
                    self.running_since = _now()
                failing = self._failed_processes()
                self._read_events(block_ms=500)
                if self.finished is not None:  # producers that exited 0 on training_finished are done
                    failing = [(p, c) for p, c in failing if c != 0 or p.role == Role.TRAINER]
                verdict = self.verdict(failing)
                if verdict.stalled and not self.stalled:
                    self.console.print(f"[yellow]Stalled: {verdict.stall_message}[/yellow]")
                self.stalled = bool(verdict.stalled)
                bar.update(task, completed=self.step, info=status_line(
                    self.metrics, self.evaluations, self.agent, self.stalled, bool(self.procs[Role.ACTOR])))
                if verdict.outcome is not None:
                    bar.update(task, info=f"{verdict.outcome.phase}: {verdict.outcome.reason}")
                    return verdict.outcome
                if failing:
                    self._restart(failing)

    def interrupt(self, *_: Any) -> None:
        self._interrupted = True

    # --- teardown ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ordered teardown: actors, preprocessor, inference, trainer, Redis; each stage waited for."""
        grace = self.spec.teardown.grace_period_seconds
        for role in roles.TEARDOWN_ORDER:
            if role == Role.REDIS:
                if self.redis_server is not None:
                    self.redis_server.stop(timeout=grace.redis)
                    self.teardown.append(Role.REDIS)
                continue
            procs = self.procs.get(role, [])
            if not procs:
                continue
            stop_all(procs, grace_seconds=grace.of(role))
            self.forced += [p.name for p in procs if p.forced]
            self.teardown.append(role)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def materialize(spec: TrainingJobSpec, cache: Path, console: Console) -> Outcome | None:
    """Materialize spec.model.path into `cache` (None when it is ready), else the job's outcome: a ModelError is
    judged as the operator judges a pod that exits with runtime.EXIT_CONFIG (Failed, InvalidSpec, the message
    naming spec.model.path); Ctrl-C during a download is an interruption."""
    console.print(f"model: {spec.model.path} (model cache {cache})", soft_wrap=True, markup=False)
    if roles.uses_sandbox_pods(spec):
        console.print("sandbox: spec.sandbox.mode is pods, but rlkube local has no pods: each snippet runs as a child "
                      "of its actor (rlkube.core.actor.sandbox: rlimits, a network namespace where this kernel "
                      "allows one, and the audit hook; the actor logs which)", soft_wrap=True, markup=False)
    try:
        path = fetch(spec, cache)  # what the operator's model init container runs
    except ModelError as exc:
        failure = Failure(*MODEL_FETCH, runtime.EXIT_CONFIG, str(exc))
        verdict = judge(Evidence(now=_now(), config_error=failure), spec).outcome
        assert verdict is not None
        return verdict
    except KeyboardInterrupt:
        return Outcome.failed(Reason.INTERRUPTED, "stopped by the user (SIGINT) while materializing the model")
    console.print(f"model: ready at {path}", soft_wrap=True, markup=False)
    return None


def run_local(manifest: dict, output_dir: Path | None = None, console: Console | None = None,
              model_cache: Path | None = None) -> RunResult:
    """Run a TrainingJob manifest to the end. A manifest that fails validation ends as Failed/InvalidSpec (the
    operator's verdict for it) before anything is started; `invalid` then holds each field's error. So does a
    model that cannot be materialized into `model_cache` (default: $RLKUBE_MODEL_CACHE, else
    ~/.cache/rlkube/models), with the message naming spec.model.path."""
    name = (manifest.get("metadata") or {}).get("name") or "job"
    try:
        meta, spec = parse_manifest(manifest)
        # The roles run this interpreter (with its PYTHONPATH): an entry point it cannot find fails here, by name.
        if errs := importable_errors(spec):
            raise SpecError(errs)
    except SpecError as exc:
        verdict = judge(Evidence(now=_now(), spec_error=str(exc)), None).outcome
        assert verdict is not None
        return RunResult(name, verdict.phase, verdict.reason, verdict.message, 0, 0, [], [], [], 0.0,
                         Path(output_dir or "."), invalid=[str(e) for e in exc.errors])
    name = meta["name"]
    console = console or Console(stderr=True)
    out = Path(output_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    t0 = time.monotonic()

    cache = Path(model_cache).expanduser().resolve() if model_cache is not None else default_cache_dir().resolve()
    failed = materialize(spec, cache, console)
    if failed is not None:  # nothing was started: no role, no Redis, no output directory
        return RunResult(name, failed.phase, failed.reason, failed.message, 0, spec.algorithm.max_steps, [], [], [],
                         time.monotonic() - t0, out)
    job = LocalJob(name, spec, manifest["spec"], out, console, model_cache=cache)
    previous = {sig: signal.signal(sig, job.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            job.start()
            outcome = job.follow()
        except (RuntimeError, OSError) as exc:
            outcome = Outcome.failed(Reason.RUNNER_ERROR, str(exc))
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
        restarts=job.restarts,
        stalled=job.stalled,
        evaluations=job.evaluations,
        updates=job.updates,
        agent=job.agent,
        conditions=[] if job.tracker_failed is None else [
            {"type": tracker_failures.CONDITION, "status": ConditionStatus.TRUE, "reason": tracker_failures.REASON,
             "message": job.tracker_failed}],
    )
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in job.metrics))
    if job.evaluations:
        (out / "evaluation.jsonl").write_text("".join(json.dumps(e) + "\n" for e in job.evaluations))
    plot_rewards(job.metrics, out / "reward.png", f"{name}: {spec.algorithm.loss} on {spec.task.name}", job.evaluations)
    if outcome.phase != Phase.SUCCEEDED:
        for procs in job.procs.values():
            for p in procs:
                if p.returncode() not in (0, None):
                    console.print(f"[red]--- last lines of {p.name} ({p.log_path}) ---[/red]\n{p.log_tail()}")
    return result


def cli(args) -> int:
    console = Console(stderr=True)
    try:
        with open(args.file) as fh:
            manifest = yaml.safe_load(fh)
        result = run_local(manifest, Path(args.output_dir) if args.output_dir else None, console,
                           Path(args.model_cache) if args.model_cache else None)
    except (RedisNotInstalled, FileNotFoundError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    if result.invalid:
        for err in result.invalid:
            console.print(f"[red]{args.file}: {err}[/red]")
        return 2
    console.print(summary_line(result))
    if args.json:
        sys.stdout.write(json.dumps(result.summary()) + "\n")
    if result.phase == Phase.SUCCEEDED:
        return 0
    return 130 if result.reason == Reason.INTERRUPTED else 1
