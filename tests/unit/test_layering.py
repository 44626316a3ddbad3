"""The package's floors, checked from the source: who may import whom, what the operator may import, and what
nothing may import.

The floors, lowest first; a module imports only modules of its own floor or of floors below it:

    0 base               rlkube (the package root), rlkube.gctune: import nothing of rlkube
    1 api                the TrainingJob types and the CRD: import nothing else of rlkube
    2 contract           what launchers and roles agree on (role environment names, Redis protocol, streams,
                         the role's context, rank arithmetic, the checkpoint-loss message)
    3 core               the role processes (trainer, inference, actor, preprocessor) and their training stack:
                         they read the contract and the already validated spec, never the launchers' rules
    4 lifecycle          what a job IS, for both launchers: roles, environment, validation, phases, judgement
    5 controller, local  the two launchers: the kopf operator and `rlkube local`; and rlkube.runs, what a job left
                         for people (`rlkube samples`, `rlkube report`)
    6 cli                the `rlkube` command, one subcommand per owning module
    7 bench              benchmarks and the fake kubelet: the top, nothing else imports it

- No import circle among rlkube modules, function-level and TYPE_CHECKING imports counted (the strongly
  connected components of the module graph are single modules).
- The operator process (rlkube.controller and everything it imports) reaches no role module: nothing of
  rlkube.core, whose training stack the operator image does not carry.
- Inside the operator, its four folders are floors of their own, lowest first (CONTROLLER_FLOORS):

    0 manifests   the child manifests, pure
    1 decisions   what the operator observes and decides, pure
    2 reconcile   the reconcile I/O: each job's loop, the event watcher, the API client, the metrics
    3 process     the process: entry, kopf handlers, leader election, the admission webhook

  Every module of rlkube.controller is in one of them, and imports only its own folder and those below. The two
  pure folders, and every rlkube module they reach, import no client or server library (IO_LIBRARIES): what they
  do is tested without an API server, a Redis or an event loop.
- No shipped module finds files relative to itself up into the repository (`parents[N]`) or reaches into the
  repository's tests/: an installed wheel has neither (tests/integration/package/test_install.py runs one).
- The operator's modules and `rlkube bench operator` import nothing of the training stack (torch, numpy, ...):
  the base install, which is all the operator image has, does not carry it (pyproject.toml, the `core` extra).

`python -m tests.unit.test_layering` prints the structure drawing: the floors and which package imports which.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "operator" / "rlkube"
TRAINING_STACK = ("torch", "numpy", "safetensors", "matplotlib", "rich", "psutil", "transformers", "datasets",
                  "math_verify", "reasoning_gym", "verifiers")

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("rlkube", "rlkube.gctune")),
    ("api", ("rlkube.api",)),
    ("contract", ("rlkube.contract",)),
    ("core", ("rlkube.core",)),
    ("lifecycle", ("rlkube.lifecycle",)),
    ("controller, local", ("rlkube.controller", "rlkube.local", "rlkube.runs")),
    ("cli", ("rlkube.cli",)),
    ("bench", ("rlkube.bench",)),
)
"""Lowest first. A package named here holds all its submodules; the root `rlkube` only itself."""
OPERATOR = "rlkube.controller"
ROLES = "rlkube.core"
CONTROLLER_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("manifests", ("rlkube.controller.manifests",)),
    ("decisions", ("rlkube.controller.decisions",)),
    ("reconcile", ("rlkube.controller.reconcile",)),
    ("process", ("rlkube.controller.process",)),
)
"""The operator's folders, lowest first; a module of one imports only its own folder and those below."""
PURE = ("rlkube.controller.manifests", "rlkube.controller.decisions")
IO_LIBRARIES = ("kopf", "aiohttp", "kubernetes_asyncio", "kubernetes", "redis")
"""What the pure folders never import, directly or through any rlkube module they import."""

Graph = Mapping[str, set[str]]


def _modules() -> dict[str, ast.Module]:
    return {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): ast.parse(p.read_text(), str(p))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def _imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


# --- the module graph ---------------------------------------------------------------------------------------


def _module_name(file_module: str) -> str:
    """`rlkube.core.__init__` -> `rlkube.core`."""
    return file_module.removesuffix(".__init__")


def module_graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    """module -> the rlkube modules it imports, from `{module name: source}` (packages under their own name, with
    `is_package` told by a `.__init__` suffix). Every import statement counts, wherever it is (module level, in a
    function, under TYPE_CHECKING): `from a.b import c` is an arrow to a.b.c when that is a module, else to a.b."""
    names = {_module_name(m) for m in sources}
    graph: dict[str, set[str]] = {}
    for file_module, source in sources.items():
        name = _module_name(file_module)
        package = name if file_module.endswith(".__init__") else name.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in names:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.add(target)
        graph[name] = out
    return graph


def _graph() -> dict[str, set[str]]:
    return module_graph({
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p.read_text()
        for p in sorted(PACKAGE.rglob("*.py"))
    })


def floor_of(module: str, floors=FLOORS) -> int | None:
    for i, (_, members) in enumerate(floors):
        if any(module == m or (m != "rlkube" and module.startswith(m + ".")) for m in members):
            return i
    return None


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_arrows(graph: Graph, floors=FLOORS) -> list[str]:
    """Every import of a module on a higher floor than the importer's, and every module on no floor."""
    out = []
    for module, targets in sorted(graph.items()):
        here = floor_of(module, floors)
        if here is None:
            out.append(f"{module} is on no floor (add it to FLOORS)")
            continue
        for target in sorted(targets):
            there = floor_of(target, floors)
            if there is None or there > here:
                where = "no floor" if there is None else floors[there][0]
                out.append(f"{module} ({floors[here][0]}) imports {target} ({where})")
    return out


def reachable(graph: Graph, starts: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(starts)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def _package(module: str, depth: int = 2) -> str:
    parts = module.split(".")
    return ".".join(parts[:depth]) if len(parts) > 1 else module


def inner_graph(graph: Graph, package: str) -> dict[str, set[str]]:
    """The arrows among the modules below `package` (the package's own `__init__` left out)."""
    def inside(module: str) -> bool:
        return module.startswith(package + ".")
    return {m: {t for t in targets if inside(t)} for m, targets in graph.items() if inside(m)}


def _under(module: str, packages: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def banned_imports(graph: Graph, trees: Mapping[str, ast.Module], starts: Iterable[str],
                   banned: Iterable[str] = IO_LIBRARIES) -> dict[str, list[str]]:
    """For every rlkube module `starts` reach (themselves included), the banned libraries it imports, wherever the
    import statement is. `trees`: module name (packages under their own name) -> its syntax tree."""
    banned = tuple(banned)
    found = {}
    for module in sorted(reachable(graph, starts)):
        hits = sorted(i for i in _imports(trees[module]) if _under(i, banned))
        if hits:
            found[module] = hits
    return found


def drawing(graph: Graph, floors=FLOORS) -> str:
    """The floors, top first, and for each package the packages it imports (the arrows all point down)."""
    arrows: dict[str, set[str]] = {}
    for module, targets in graph.items():
        arrows.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module)
        )
    lines = ["rlkube floors, top first; a package imports only what is on its floor or below (tests/unit/test_layering.py)"]
    for i in reversed(range(len(floors))):
        name, _ = floors[i]
        packages = sorted(p for p in arrows if floor_of(p, floors) == i)
        lines.append(f"{i} {name}")
        for package in packages:
            below = sorted(arrows[package], key=lambda p: (-(floor_of(p, floors) or 0), p))
            lines.append(f"    {package:20} -> {', '.join(below) if below else '(nothing of rlkube)'}")
    return "\n".join(lines)


def controller_drawing(graph: Graph) -> str:
    """The operator's folders, top first, each with its modules and the folders it imports."""
    inner = inner_graph(graph, OPERATOR)
    lines = [f"{OPERATOR} floors, top first; a folder imports only itself and the folders below it"]
    for i in reversed(range(len(CONTROLLER_FLOORS))):
        name, (folder,) = CONTROLLER_FLOORS[i]
        modules = sorted(m.rpartition(".")[2] for m in inner if m.startswith(folder + "."))
        below = {_package(t, 3) for m, targets in inner.items() if m.startswith(folder + ".") for t in targets}
        below = sorted((b for b in below if b != folder), key=lambda b: -(floor_of(b, CONTROLLER_FLOORS) or 0))
        lines.append(f"{i} {name:10} ({len(modules)} modules) -> {', '.join(below) if below else '(no other folder)'}")
        lines.append(f"    {', '.join(modules)}")
    return "\n".join(lines)


def summary(graph: Graph) -> str:
    """What `python -m tests.unit.test_layering` prints: both drawings and what the checks count."""
    trees = {_module_name(k): v for k, v in _modules().items()}
    pure = [m for m in graph if _under(m, PURE)]
    bans = banned_imports(graph, trees, pure)
    return "\n".join([
        drawing(graph),
        "",
        controller_drawing(graph),
        "",
        f"modules: {len(graph)}; import circles: {len(cycles(graph))}; arrows up: {len(upward_arrows(graph))}; "
        f"arrows up inside {OPERATOR}: {len(upward_arrows(inner_graph(graph, OPERATOR), CONTROLLER_FLOORS))}",
        f"{' and '.join(PURE)}: {len(pure)} modules reaching {len(reachable(graph, pure))} rlkube modules; "
        f"imports of {', '.join(IO_LIBRARIES)} among them: {sum(map(len, bans.values()))}",
        f"rlkube.core: folders {', '.join(sorted(core_folders(graph)))}; loose: {', '.join(sorted(CORE_LOOSE))}; "
        f"layout problems: {len(core_layout_problems(graph))}",
    ])


# --- the checks ---------------------------------------------------------------------------------------------


def test_no_import_circle():
    graph = _graph()
    assert "rlkube.core.actor.tasks" in graph and "rlkube.lifecycle.validation" in graph
    assert cycles(graph) == []


def test_every_module_is_on_a_floor_and_imports_nothing_above_it():
    assert upward_arrows(_graph()) == []


def test_api_imports_nothing_else_of_rlkube():
    graph = _graph()
    api = {m for m in graph if floor_of(m) == floor_of("rlkube.api")}
    assert api >= {"rlkube.api", "rlkube.api.spec", "rlkube.api.status", "rlkube.api.crd"}
    assert {m: sorted(t - api) for m in sorted(api) if (t := graph[m]) - api} == {}


def test_the_operator_reaches_no_role_module():
    graph = _graph()
    operator = reachable(graph, (m for m in graph if m == OPERATOR or m.startswith(OPERATOR + ".")))
    assert "rlkube.contract.protocol" in operator  # the watcher reads the trainer's events
    assert sorted(m for m in operator if m == ROLES or m.startswith(ROLES + ".")) == []


def test_bench_is_the_top_floor():
    assert floor_of("rlkube.bench.simulate") == len(FLOORS) - 1
    assert FLOORS[-1] == ("bench", ("rlkube.bench",))


def test_the_checks_catch_an_upward_import_and_a_circle():
    # The real graph plus what this repository had before its floors were drawn: rlkube.api.validation importing
    # the controller's names (api -> controller), and the core's runtime importing the validation that imported
    # the environment that imported the runtime (a circle, and contract -> lifecycle upward).
    graph = {m: set(t) for m, t in _graph().items()}
    assert cycles(graph) == [] and upward_arrows(graph) == []
    graph["rlkube.api.spec"].add("rlkube.controller.manifests.names")
    assert upward_arrows(graph) == [
        "rlkube.api.spec (api) imports rlkube.controller.manifests.names (controller, local)"]
    graph["rlkube.contract.runtime"].add("rlkube.lifecycle.validation")
    assert any({"rlkube.contract.runtime", "rlkube.lifecycle.environment", "rlkube.lifecycle.validation"} <= set(c)
               for c in cycles(graph)), cycles(graph)
    assert "rlkube.contract.runtime (contract) imports rlkube.lifecycle.validation (lifecycle)" in upward_arrows(graph)
    graph["rlkube.controller.manifests.builders"].add("rlkube.core.trainer")
    operator = reachable(graph, [m for m in graph if m.startswith(OPERATOR + ".")])
    assert "rlkube.core.trainer" in operator


def test_the_graph_counts_imports_in_functions_and_relative_ones():
    sources = {
        "rlkube.__init__": "",
        "rlkube.api.__init__": "",
        "rlkube.api.spec": "def f():\n    from rlkube.controller import names\n",
        "rlkube.controller.__init__": "",
        "rlkube.controller.names": "from . import loop\n",
        "rlkube.controller.loop": "if True:\n    import rlkube.api.spec\n",
    }
    graph = module_graph(sources)
    assert graph["rlkube.api.spec"] == {"rlkube.controller.names"}
    assert graph["rlkube.controller.names"] == {"rlkube.controller.loop"}
    assert graph["rlkube.controller.loop"] == {"rlkube.api.spec"}
    assert cycles(graph) == [["rlkube.api.spec", "rlkube.controller.loop", "rlkube.controller.names"]]
    assert upward_arrows(graph) == ["rlkube.api.spec (api) imports rlkube.controller.names (controller, local)"]


def test_the_drawing_names_every_floor():
    text = drawing(_graph())
    for i, (name, _) in enumerate(FLOORS):
        assert f"{i} {name}" in text
    assert "rlkube.api" in text and "rlkube.bench" in text


def test_nothing_outside_bench_imports_bench():
    modules = _modules()
    assert "rlkube.bench.simulate" in modules and "rlkube.bench.operator" in modules
    offenders = {
        name: sorted(i for i in _imports(tree) if i == "rlkube.bench" or i.startswith("rlkube.bench."))
        for name, tree in modules.items()
        if not name.startswith("rlkube.bench")
    }
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_the_check_above_sees_an_import_of_bench():
    tree = ast.parse("def f():\n    from rlkube.bench.simulate import FakeKubelet\n")
    assert "rlkube.bench.simulate" in _imports(tree)


def test_no_shipped_module_reaches_into_the_repository():
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(ROOT)
        assert ".parents[" not in text, f"{rel} finds files through parents[N]"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith(("tests/", "examples/")), f"{rel} names {node.value!r}"
        assert "sys.path.insert" not in text, f"{rel} edits sys.path"


def test_the_operator_and_the_operator_bench_import_no_training_stack():
    # In a fresh interpreter (this one may have torch loaded already): import what the operator image runs and
    # what `rlkube bench operator` runs, build every CLI parser, and list what of the training stack got loaded,
    # and which role modules (rlkube.core) the operator's own modules loaded.
    # opentelemetry is blocked (an ImportError, as for a package not installed) because the operator image lacks it:
    # images/operator/Dockerfile installs the base dependencies only, while here the trackers of the `core` extra
    # (mlflow-skinny, wandb) bring it in, and redis-py imports it whenever it is there (its SDK then imports psutil).
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import rlkube.cli, rlkube.controller.process.entry, rlkube.controller.process.main, "
        "rlkube.controller.process.handlers, rlkube.controller.reconcile.loop\n"
        "print(sorted(m for m in sys.modules if m == 'rlkube.core' or m.startswith('rlkube.core.')))\n"
        "import rlkube.bench.operator\n"
        "rlkube.cli.build_parser().parse_args(['bench', 'operator', '--jobs', '2', '--kubeconfig', 'k'])\n"
        f"print(sorted(m for m in {TRAINING_STACK!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout


def test_the_controller_folders_are_floors():
    graph = _graph()
    inner = inner_graph(graph, OPERATOR)
    assert {"rlkube.controller.manifests.builders", "rlkube.controller.decisions.recipe",
            "rlkube.controller.reconcile.loop", "rlkube.controller.process.main"} <= set(inner)
    assert graph[OPERATOR] == set()  # the package itself: a docstring, no module loose beside the folders
    assert upward_arrows(inner, CONTROLLER_FLOORS) == []
    for name, (folder,) in CONTROLLER_FLOORS:
        assert folder in graph, f"{folder} ({name}) is missing"


def test_the_controller_floor_check_catches_an_upward_import_and_a_loose_module():
    inner = inner_graph({m: set(t) for m, t in _graph().items()}, OPERATOR)
    inner["rlkube.controller.manifests.builders"].add("rlkube.controller.decisions.observed")
    inner["rlkube.controller.decisions.recipe"].add("rlkube.controller.reconcile.kube")
    inner["rlkube.controller.loose"] = set()
    assert upward_arrows(inner, CONTROLLER_FLOORS) == [
        "rlkube.controller.decisions.recipe (decisions) imports rlkube.controller.reconcile.kube (reconcile)",
        "rlkube.controller.loose is on no floor (add it to FLOORS)",
        "rlkube.controller.manifests.builders (manifests) imports rlkube.controller.decisions.observed (decisions)",
    ]


def test_the_pure_folders_reach_no_client_or_server_library():
    graph = _graph()
    trees = {_module_name(k): v for k, v in _modules().items()}
    pure = [m for m in graph if _under(m, PURE)]
    assert "rlkube.controller.decisions.recipe" in pure and "rlkube.controller.manifests.builders" in pure
    assert "rlkube.contract.protocol" in reachable(graph, pure)  # the check follows them out of the controller
    assert banned_imports(graph, trees, pure) == {}
    # ... and sees the operator's own I/O modules, wherever their imports are.
    io = [m for m in graph if _under(m, ("rlkube.controller.reconcile", "rlkube.controller.process"))]
    found = banned_imports(graph, trees, io)
    assert {"aiohttp", "kopf", "redis.exceptions"} <= set(found["rlkube.controller.reconcile.loop"])
    assert "kopf._cogs.clients" in found["rlkube.controller.process.watchdecode"]  # in a function


def test_the_ban_check_catches_an_import_in_a_function_and_through_another_module():
    graph = {"rlkube.controller.decisions.a": {"rlkube.lifecycle.b"}, "rlkube.lifecycle.b": set()}
    trees = {"rlkube.controller.decisions.a": ast.parse("import rlkube.lifecycle.b\n"),
             "rlkube.lifecycle.b": ast.parse("def f():\n    from redis.asyncio import Redis\n")}
    assert banned_imports(graph, trees, ["rlkube.controller.decisions.a"]) == {
        "rlkube.lifecycle.b": ["redis.asyncio", "redis.asyncio.Redis"]}


def test_the_pure_folders_load_no_client_or_server_library():
    # What the static check above cannot see: a third-party library of theirs that loads one. In a fresh
    # interpreter, import every module of the pure folders and list which of IO_LIBRARIES got loaded.
    modules = sorted(m for m in _graph() if _under(m, PURE))
    code = (
        f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {IO_LIBRARIES!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.stdout.split("\n")[0] == "[]", out.stdout


# The core's modules live in folders: one per role, the shared training stack, the launchers, the weight transfer,
# the model format, the trackers. Only these are loose in rlkube.core: what every role process shares.
CORE_LOOSE = {"rlkube.core.errors", "rlkube.core.startup"}
# The training stack is below the trainer and every backend: it imports neither, nor any role.
TRAINING = "rlkube.core.training"
ABOVE_TRAINING = tuple(f"rlkube.core.{p}" for p in (
    "trainer", "backends", "actor", "preprocessor", "inference", "sandbox", "launch", "tracking"))


def core_folders(graph: Graph) -> set[str]:
    return {m.split(".")[2] for m in graph if m.startswith("rlkube.core.") and m.count(".") >= 3}


def core_layout_problems(graph: Graph) -> list[str]:
    problems = []
    for module in sorted(graph):
        if module.count(".") == 2 and module.startswith("rlkube.core.") and module not in CORE_LOOSE \
                and not any(m.startswith(module + ".") for m in graph):
            problems.append(f"{module} is loose in rlkube.core: move it into its role's folder")
        if _under(module, (TRAINING,)):
            problems += [f"{module} (the training stack) imports {t}" for t in sorted(graph[module])
                         if _under(t, ABOVE_TRAINING)]
    return problems


def test_the_core_is_folders_and_the_training_stack_is_below_its_users():
    graph = _graph()
    assert {"rlkube.core.training.checkpoint", "rlkube.core.launch.ranks", "rlkube.core.inference.sampling",
            "rlkube.core.weights.fast_llm"} <= set(graph)
    assert "rlkube.core.training.lora" in graph["rlkube.core.trainer.api"]
    assert core_layout_problems(graph) == []


def test_the_core_layout_check_catches_a_loose_module_and_an_upward_import():
    graph = {m: set(t) for m, t in _graph().items()}
    graph["rlkube.core.helpers"] = set()
    graph["rlkube.core.training.losses"].add("rlkube.core.trainer.api")
    assert core_layout_problems(graph) == [
        "rlkube.core.helpers is loose in rlkube.core: move it into its role's folder",
        "rlkube.core.training.losses (the training stack) imports rlkube.core.trainer.api",
    ]


if __name__ == "__main__":
    print(summary(_graph()))
