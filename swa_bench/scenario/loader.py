"""Reading a scenario file: every way it can be wrong becomes one ScenarioError line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from swa_bench.scenario.errors import ScenarioError, dotted, located, yaml_index
from swa_bench.scenario.schema import Scenario, describe_error
from swa_bench.scenario.sweep import expand_cases


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


def parse_yaml(text: str, file: str) -> Any:
    """Safe-load ``text``; a syntax error names the parser's line."""
    try:
        return yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err)
        raise ScenarioError(file, "", f"invalid YAML: {problem}",
                            mark.line + 1 if mark is not None else None) from None


def _read(path: Path, file: str) -> str:
    if not path.exists():
        raise ScenarioError(file, "", "no such file")
    if path.is_dir():
        raise ScenarioError(file, "", "is a directory, not a scenario file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ScenarioError(file, "", f"cannot read: not UTF-8 text ({err.reason})") from None
    except OSError as err:
        raise ScenarioError(file, "", f"cannot read: {err.strerror or err}") from None


def scenario_from_text(text: str, file: str | Path | None = None) -> Scenario:
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
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as err:
        loc, message = describe_error(err.errors()[0])
        raise located(name, text, loc, message) from None
    scenario.source_path = Path(file) if file is not None else None
    scenario.source_text = text
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Load and fully validate a scenario file, every sweep case included.

    Raises ScenarioError (one line, naming the file and the field) for anything wrong with it.
    """
    file = str(path)
    scenario = scenario_from_text(_read(Path(path), file), path)
    expand_cases(scenario)
    return scenario


def default_scenario_path() -> Path:
    """``<repo>/scenarios/smoke.yaml``: what ``swa-bench run`` runs with no argument."""
    return Path(__file__).resolve().parents[2] / "scenarios" / "smoke.yaml"
