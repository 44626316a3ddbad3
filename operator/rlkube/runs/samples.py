"""`rlkube samples RUN`: the rollout samples a job kept (`spec.samples`, docs/design.md §5.7), from a local run's output
directory (or a samples.jsonl file) or from a job in a cluster (through the API server, rlkube.runs.kube), filtered by
step, kind and reward, as a table in a terminal or JSON (`--json`)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkube.contract import samples as contract


def rows_of(run: str, namespace: str = "default", kubeconfig: str | None = None,
            context: str | None = None, verbose: bool = False) -> list[dict[str, Any]]:
    """Every row a run kept. `run`: a local run's output directory, a samples file, or a TrainingJob's name."""
    path = Path(run)
    if path.is_dir():
        if not (path / contract.FILE).exists():
            raise FileNotFoundError(f"{path / contract.FILE}: no samples in this run's output (spec.samples."
                                    "everySteps 0, or no step kept yet)")
        return local_rows(path)
    if path.is_file():
        return list(contract.read_rows(path))
    if "/" in run or run.startswith("."):
        raise FileNotFoundError(f"{run}: no such run directory or file")
    from rlkube.runs.kube import read_job_file

    got = read_job_file(namespace, run, contract.FILE, kubeconfig, context)
    rows = list(contract.parse_text(got.text))
    mine = contract.of_run(rows, got.uid)
    if verbose:
        print(f"read {got.where}: {len(mine)} rows of this job (uid {got.uid})"
              + (f", {len(rows) - len(mine)} of earlier jobs on the same volume left out" if len(mine) < len(rows)
                 else ""), file=sys.stderr)
    return mine


def local_rows(directory: Path) -> list[dict[str, Any]]:
    """The rows a local run directory's run kept: those of the run its job.json names (`uid`), else every row."""
    path = Path(directory) / contract.FILE
    if not path.exists():
        return []
    uid = None
    try:
        uid = json.loads((Path(directory) / "job.json").read_text()).get("uid")
    except (OSError, ValueError, AttributeError):
        pass
    return contract.of_run(contract.read_rows(path), uid)


@dataclass(frozen=True)
class Filter:
    steps: tuple[tuple[int, int], ...] = ()  # inclusive ranges; empty: every step
    kind: str | None = None  # train, evaluation
    min_reward: float | None = None
    max_reward: float | None = None
    last: int | None = None  # only the rows of the newest N steps kept

    def __call__(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for r in rows:
            step, reward = r.get("step"), r.get("reward")
            if self.kind and r.get("kind") != self.kind:
                continue
            if self.steps and not (isinstance(step, int) and any(a <= step <= b for a, b in self.steps)):
                continue
            if self.min_reward is not None and not (isinstance(reward, int | float) and reward >= self.min_reward):
                continue
            if self.max_reward is not None and not (isinstance(reward, int | float) and reward <= self.max_reward):
                continue
            out.append(r)
        if self.last:
            keep = sorted({r.get("step") for r in out if isinstance(r.get("step"), int)})[-self.last:]
            out = [r for r in out if r.get("step") in keep]
        return out


def parse_steps(values: list[str]) -> tuple[tuple[int, int], ...]:
    """`30`, `20:40` (inclusive) or `40:` / `:10`, each a range of steps."""
    out = []
    for v in values:
        try:
            if ":" in v:
                a, _, b = v.partition(":")
                out.append((int(a) if a else 0, int(b) if b else 2**63))
            else:
                out.append((int(v), int(v)))
        except ValueError:
            raise ValueError(f"--step {v!r}: a step (30) or an inclusive range (20:40, 40:)") from None
    return tuple(out)


def _completion(row: dict[str, Any]) -> str:
    """The completion as turns, the environment's answers (masked out of the loss) marked."""
    turns = row.get("turns") or []
    if len(turns) <= 1:
        return str(row.get("completion", ""))
    return "\n".join(f"[env] {t.get('text', '')}" if t.get("masked") else f"[model] {t.get('text', '')}"
                     for t in turns)


def _num(value: Any, fmt: str = "{:.3f}") -> str:
    return fmt.format(value) if isinstance(value, int | float) else "-"


def _completion_text(row: dict[str, Any]) -> Any:
    """The completion for rich: the environment's answers (masked out of the loss) dim and marked, never markup."""
    from rich.text import Text

    turns = row.get("turns") or []
    if len(turns) <= 1:
        return Text(str(row.get("completion", "")))
    out = Text()
    for i, t in enumerate(turns):
        if i:
            out.append("\n")
        if t.get("masked"):
            out.append(f"[env] {t.get('text', '')}", style="dim")
        else:
            out.append(f"[model] {t.get('text', '')}")
    return out


def table(rows: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table
    from rich.text import Text

    t = Table(title=title, show_lines=True)
    for name, kw in (("kind", {}), ("step", {"justify": "right"}), ("ver", {"justify": "right"}),
                     ("lag", {"justify": "right"}), ("prompt", {"overflow": "fold", "ratio": 2}),
                     ("completion", {"overflow": "fold", "ratio": 3}), ("reward", {"justify": "right"}),
                     ("adv", {"justify": "right"}), ("finish", {}), ("turns/tools", {"justify": "right"})):
        t.add_column(name, **kw)
    for r in rows:
        ep = r.get("episode") or {}
        t.add_row(str(r.get("kind", "")), str(r.get("step", "")), str(r.get("weight_version", "")),
                  str(r.get("lag", "")) if r.get("lag") is not None else "-", Text(str(r.get("prompt", ""))),
                  _completion_text(r), _num(r.get("reward")), _num(r.get("advantage"), "{:+.3f}"),
                  Text(str(r.get("finish_reason", ""))),
                  f"{ep.get('turns', '')}/{ep.get('tool_calls', '')}" if ep else "-")
    return t


def cli(args) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    try:
        flt = Filter(parse_steps(args.step or []), args.kind, args.min_reward, args.max_reward, args.last)
        rows = flt(rows_of(args.run, args.namespace, args.kubeconfig, args.context, args.verbose))
    except (FileNotFoundError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    except RuntimeError as exc:  # rlkube.runs.kube.JobFilesError, API errors
        err.print(f"[red]{args.run}: {exc}[/red]")
        return 1
    if args.json:
        sys.stdout.write(json.dumps(rows, ensure_ascii=False) + "\n")
        return 0
    if not rows:
        err.print("no samples match")
        return 0
    Console(width=args.width).print(table(rows, f"{args.run}: {len(rows)} samples"))
    return 0


def _plain_cli(args) -> int:
    """Without rich (the base install has none): the same rows, one block each."""
    try:
        flt = Filter(parse_steps(args.step or []), args.kind, args.min_reward, args.max_reward, args.last)
        rows = flt(rows_of(args.run, args.namespace, args.kubeconfig, args.context, args.verbose))
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"{args.run}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(rows, ensure_ascii=False) + "\n")
        return 0
    for r in rows:
        print(f"--- {r.get('kind')} step {r.get('step')} version {r.get('weight_version')} lag {r.get('lag')} "
              f"reward {_num(r.get('reward'))} advantage {_num(r.get('advantage'))} {r.get('finish_reason')}")
        print(f"prompt: {r.get('prompt', '')}\n{_completion(r)}")
    return 0


def run(args) -> int:
    try:
        import rich  # noqa: F401 - the `core` extra
    except ImportError:
        return _plain_cli(args)
    return cli(args)


def add_parser(sub) -> None:
    p = sub.add_parser("samples", help="print the rollout samples a job kept (spec.samples)")
    p.add_argument("run", help="a local run's output directory (or its samples.jsonl), or a TrainingJob's name")
    p.add_argument("-n", "--namespace", default="default", help="the job's namespace (a TrainingJob name)")
    p.add_argument("--kubeconfig", default=None, help="the cluster (default $KUBECONFIG, ~/.kube/config, in-cluster)")
    p.add_argument("--context", default=None, help="the kubeconfig context")
    p.add_argument("--step", action="append", default=None, metavar="STEP",
                   help="only this step (30) or inclusive range (20:40, 40:); repeatable")
    p.add_argument("--last", type=int, default=None, metavar="N", help="only the newest N steps kept")
    p.add_argument("--kind", choices=(contract.TRAIN, contract.EVALUATION), default=None,
                   help="training samples or the evaluation's")
    p.add_argument("--min-reward", type=float, default=None)
    p.add_argument("--max-reward", type=float, default=None)
    p.add_argument("--json", action="store_true", help="one JSON list of the rows on stdout")
    p.add_argument("--width", type=int, default=None, help="table width (default: the terminal's)")
    p.set_defaults(func=run)
