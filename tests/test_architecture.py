"""The package's shape: imports point one way, no modules import each other (lazily or not), the
model loads no benchmark machinery, and nothing below the engine reads the environment.

kernels <- model (and the task data) <- replay <- runtime (graphs, engine, parallel, training)
<- checks, bench (and the data they produce: results, scenarios) <- compare (pure statistics)
<- reports (rendering, compare's included) <- run orchestration (every command body) <- cli.
Settings the environment gives (the kernels' ``SWA_BENCH_*`` defaults, Triton's interpreter
switch) are read at the engine or above and reach the layers below as values (``Kernels`` in the
forward context), so a run records what it ran.
"""

import ast
import subprocess
import sys
from pathlib import Path

import swa_bench

LAYERS = [
    ("kernels", ["swa_bench.kernels"]),
    ("model", ["swa_bench.model", "swa_bench.tasks"]),
    ("replay", ["swa_bench.replay"]),
    ("runtime", ["swa_bench.graphs", "swa_bench.engine", "swa_bench.parallel", "swa_bench.train"]),
    ("checks and bench", ["swa_bench.checks", "swa_bench.bench", "swa_bench.results",
                          "swa_bench.scenario"]),
    ("compare", ["swa_bench.compare"]),
    ("reports", ["swa_bench.report"]),
    ("run", ["swa_bench.run"]),
    ("cli", ["swa_bench.cli", "swa_bench.__main__"]),
]
ROOT = Path(swa_bench.__file__).parent


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every swa_bench module ``path`` imports, at any depth (lazy imports in functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("swa_bench")}


def test_every_module_has_a_layer():
    modules = [module_name(p) for p in ROOT.rglob("*.py")]
    assert [m for m in modules if m != "swa_bench" and layer_of(m) is None] == []


def test_imports_point_one_way():
    backwards = []
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        if name == "swa_bench":
            continue
        own = layer_of(name)
        for target in imports(path):
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                backwards.append(f"{name} ({LAYERS[own][0]}) imports {target} "
                                 f"({LAYERS[theirs][0]})")
    assert backwards == []


def test_the_model_loads_no_benchmark_machinery():
    code = (
        "import sys, swa_bench.model.model\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('pandas', 'pydantic') "
        "or m.startswith(('swa_bench.bench', 'swa_bench.replay', 'swa_bench.engine', "
        "'swa_bench.results', 'swa_bench.graphs'))]\n"
        "print(sorted(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_layer_check_sees_a_backward_import(tmp_path):
    """The checker itself: a model module importing the engine is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("from swa_bench.engine.engine import Engine\n")
    assert imports(bad) == {"swa_bench.engine.engine", "swa_bench.engine.engine.Engine"}
    assert layer_of("swa_bench.engine.engine") > layer_of("swa_bench.model.model")


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` -> the package's modules it imports, at any depth
    (lazy and type-only imports too). ``from a import b`` is an edge to the module ``a.b`` when
    there is one, else to ``a``; the implicit import of a submodule's parent package is no edge
    (every submodule has it: a package's ``__init__`` importing its own submodules is no cycle)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {_longest_module(a.name, paths) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in paths else _longest_module(base, paths))
        graph[name] = targets - {None}
    return graph


def _longest_module(dotted: str, modules) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its path, first module repeated at the end) per strongly connected group of
    modules (Tarjan), so every tangle is named once; [] when the imports form a DAG."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1 or node in graph.get(node, ()):
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(_cycle_through(min(group), group, graph) for group in groups)


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest import path from ``start`` back to itself inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a cycle group but on no cycle")


def test_no_import_cycles():
    """A cycle across layers is already a backward import; this sees the ones inside a layer
    (compare and report/console importing each other lazily passed the layer rule)."""
    assert [" -> ".join(cycle) for cycle in import_cycles(module_graph(ROOT))] == []


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    """The checker itself: a cycle closed by an import inside a function is reported with its
    path; a package ``__init__`` importing its submodules, and ``from pkg import module``, are not
    cycles."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.c import C\n")
    (package / "a.py").write_text("import pkg.b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import A\n")
    (package / "c.py").write_text("from pkg import d\n")
    (package / "d.py").write_text("from . import e\n")
    (package / "e.py").write_text("X = 1\n")
    graph = module_graph(package)
    assert graph["pkg.c"] == {"pkg.d"} and graph["pkg.d"] == {"pkg.e"}
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    (package / "e.py").write_text("from pkg import C\n")
    assert import_cycles(module_graph(package)) == [["pkg", "pkg.c", "pkg.d", "pkg.e", "pkg"],
                                                    ["pkg.a", "pkg.b", "pkg.a"]]


# Layers that take their settings as values: none of them reads the process environment.
BELOW_ENGINE = ("swa_bench.kernels", "swa_bench.model", "swa_bench.tasks", "swa_bench.replay")
ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def environment_reads(path: Path) -> list[str]:
    """Each place ``path`` touches the process environment: ``os.environ`` / ``os.getenv`` /
    ``os.putenv`` (under any name ``os`` is imported as), or those names imported from os."""
    tree = ast.parse(path.read_text())
    aliases = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for a in node.names if a.name == "os"}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names
                      if a.name in ENVIRONMENT or a.name == "*"]
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_nothing_below_the_engine_reads_the_environment():
    reads = [f"{module_name(path)}:{where}" for path in sorted(ROOT.rglob("*.py"))
             if module_name(path).startswith(BELOW_ENGINE) for where in environment_reads(path)]
    assert reads == []


def test_the_environment_check_sees_every_spelling(tmp_path):
    """The checker itself: each way of reading the environment is reported, plain ``os`` use
    is not."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nimport os as system\nfrom os import environ, getenv, sep\n"
                   "a = os.environ.get('X')\nb = os.getenv('X')\nos.putenv('X', '1')\n"
                   "c = system.environ['X']\nd = os.path.join('a', 'b')\n")
    assert environment_reads(bad) == ["3: from os import environ", "3: from os import getenv",
                                      "4: os.environ", "5: os.getenv", "6: os.putenv",
                                      "7: system.environ"]
    good = tmp_path / "good.py"
    good.write_text("import os\nd = os.sep + os.path.join('a', 'b')\n")
    assert environment_reads(good) == []
