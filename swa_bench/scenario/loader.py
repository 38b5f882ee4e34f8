"""Reading a scenario file: every way it can be wrong becomes one ScenarioError line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from swa_bench.scenario.errors import ScenarioError, dotted, located, yaml_index
from swa_bench.scenario.schema import MAX_CASES, Scenario, describe_error
from swa_bench.scenario.sweep import Case, expand_cases


class _SafeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads ``1e-5`` as a float.

    YAML 1.1 floats need a dot, so PyYAML reads ``rtol: 1e-5`` as the string "1e-5"; scenario
    authors copy tolerances in that form, and strict validation would then reject them.
    """


_SafeLoader.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


MAX_FILE_BYTES = 1_000_000
MAX_NODES = 100_000
MAX_DEPTH = 50
MAX_INT = 2**63 - 1


def _yaml_error(err: yaml.YAMLError, file: str) -> ScenarioError:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    return ScenarioError(file, "", f"invalid YAML: {problem}",
                         mark.line + 1 if mark is not None else None)


def _check_shape(root: yaml.Node, file: str) -> None:
    """Refuse documents whose aliases expand past MAX_NODES ("billion laughs"), that refer to
    themselves, or that nest past MAX_DEPTH, before anything walks the expanded tree: every
    later step (validation, sweep expansion, hashing a case) would follow the aliases."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    aliased = False

    def size(node: yaml.Node, loc: tuple[str | int, ...]) -> int:
        nonlocal aliased
        key = id(node)
        if key in sizes:
            aliased = True
            return sizes[key]
        line = node.start_mark.line + 1
        if key in open_nodes:
            raise ScenarioError(file, dotted(loc), "a YAML alias refers to a node that contains "
                                                   "it", line)
        if len(loc) > MAX_DEPTH:
            raise ScenarioError(file, "", f"nested deeper than {MAX_DEPTH} levels", line)
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            children = [(loc, k) for k, _ in node.value] + [
                ((*loc, str(k.value)), v) for k, v in node.value]
        elif isinstance(node, yaml.SequenceNode):
            children = [((*loc, i), item) for i, item in enumerate(node.value)]
        else:
            children = []
        for child_loc, child in children:
            total += size(child, child_loc)
            if total > MAX_NODES:
                how = ("YAML aliases expand to" if aliased else "holds")
                raise ScenarioError(file, dotted(loc), f"{how} more than {MAX_NODES} values; a "
                                    "scenario is a few dozen lines", line)
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root, ())


def _check_ints(data: Any, file: str, text: str) -> None:
    """Integers beyond 64 bits validate as Python ints but fail in torch at run time."""
    stack: list[tuple[Any, tuple]] = [(data, ())]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and abs(value) > MAX_INT:
            raise located(file, text, loc, f"{value:.3g} is out of range (at most 2**63 - 1)")
        if isinstance(value, dict):
            stack += [(v, (*loc, str(k))) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, (*loc, i)) for i, v in enumerate(value)]


def parse_yaml(text: str, file: str) -> Any:
    """Safe-load ``text``; a syntax error names the parser's line. Oversized, self-referring,
    too deep or alias-bombed documents are refused before they are built."""
    if len(text) > MAX_FILE_BYTES:
        raise ScenarioError(file, "", f"file is larger than {MAX_FILE_BYTES // 1000} kB; "
                                      "a scenario is a few dozen lines")
    try:
        root = yaml.compose(text, Loader=_SafeLoader)
        if root is None:
            return None
        _check_shape(root, file)
        return yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as err:
        raise _yaml_error(err, file) from None
    except RecursionError:
        raise ScenarioError(file, "", f"nested deeper than {MAX_DEPTH} levels") from None


def _read(path: Path, file: str) -> str:
    try:
        if path.is_dir():
            raise ScenarioError(file, "", "is a directory, not a scenario file")
        if path.exists() and not path.is_file():
            raise ScenarioError(file, "", "is not a regular file (a device, pipe or socket)")
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ScenarioError(file, "", f"file is larger than {MAX_FILE_BYTES // 1000} kB; "
                                          "a scenario is a few dozen lines")
        return data.decode("utf-8")
    except FileNotFoundError:
        raise ScenarioError(file, "", "no such file") from None
    except UnicodeDecodeError as err:
        raise ScenarioError(file, "", f"cannot read: not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise ScenarioError(file, "", f"cannot read: {err.strerror or err}") from None


def scenario_from_text(text: str, file: str | Path | None = None, *,
                       max_cases: int | None = None) -> Scenario:
    """Validate scenario text (schema only; ``expand_cases`` checks each case)."""
    name = str(file) if file is not None else "<scenario>"
    data = parse_yaml(text, name)
    if data is None:
        raise ScenarioError(name, "", "empty scenario: expected a mapping with at least "
                                      "`name` and `workload`")
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else f"the {type(data).__name__} {data!r}"
        raise ScenarioError(name, "", f"the top level must be a mapping of scenario fields, "
                                      f"got {kind}", 1)
    duplicates = yaml_index(text)[1]
    if duplicates:
        loc, line = duplicates[0]
        raise ScenarioError(name, dotted(loc), "duplicate key", line)
    _check_ints(data, name, text)
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        loc, message = describe_error(err.errors()[0])
        raise located(name, text, loc, message) from None
    return scenario.bind_source(file, text, MAX_CASES if max_cases is None else max_cases)


def load_cases(path: str | Path, *, max_cases: int | None = None) -> tuple[Scenario, list[Case]]:
    """Load and fully validate a scenario file, every sweep case included: the scenario and its
    cases, expanded once.

    ``max_cases`` caps the sweep (default ``MAX_CASES``); the scenario keeps the cap, so later
    ``expand_cases`` calls honour it. Raises ScenarioError (one line, naming the file and the
    field) for anything wrong with it.
    """
    file = str(path)
    scenario = scenario_from_text(_read(Path(path), file), path, max_cases=max_cases)
    return scenario, expand_cases(scenario)


def load_scenario(path: str | Path, *, max_cases: int | None = None) -> Scenario:
    """``load_cases`` without the cases (they were expanded to validate them)."""
    return load_cases(path, max_cases=max_cases)[0]


def shipped_scenarios() -> dict[str, Path]:
    """The scenarios installed with the package, by file stem (``smoke``, ...)."""
    folder = Path(__file__).resolve().parents[1] / "scenarios"
    return {path.stem: path for path in sorted(folder.glob("*.yaml"))}


def default_scenario_path() -> Path:
    """The shipped smoke scenario: what ``swa-bench run`` runs with no argument."""
    return shipped_scenarios()["smoke"]


def resolve_scenario_path(arg: str | Path) -> Path:
    """A path that exists is a file; otherwise a bare name (``smoke``) names a shipped scenario.
    Anything else stays as given, so loading it reports "no such file"."""
    path = Path(arg)
    try:
        if path.exists() or path.suffix or len(path.parts) != 1:
            return path
    except OSError:
        return path
    return shipped_scenarios().get(str(arg), path)
