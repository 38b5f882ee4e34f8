"""The package's shape: imports point one way, the model loads no benchmark machinery, and
nothing below the engine reads the environment.

kernels <- model (and the task data) <- replay <- runtime (graphs, engine, parallel, training)
<- checks, bench (and the data they produce: results, scenarios) <- reports, compare <- run
orchestration <- cli. Settings the environment gives (the kernels' ``SWA_BENCH_*`` defaults,
Triton's interpreter switch) are read at the engine or above and reach the layers below as
values (``Kernels`` in the forward context), so a run records what it ran.
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
    ("reports", ["swa_bench.report", "swa_bench.compare"]),
    ("run", ["swa_bench.run"]),
    ("cli", ["swa_bench.cli", "swa_bench.__main__"]),
]
ROOT = Path(swa_bench.__file__).parent


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
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
