"""Sweep expansion: one scenario file -> the cases it names.

Each case is the base scenario with its axis values substituted, re-validated as a whole scenario
(schema and ``Scenario.problems()``), so a case that exists is a case that can run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from swa_bench.engine.config import EngineConfig
from swa_bench.model.args import MODEL_FIELDS, ModelArgs
from swa_bench.model.requests import RequestSpec
from swa_bench.scenario.errors import Loc, ScenarioError, dotted, line_of, located
from swa_bench.scenario.schema import Scenario, Sweep, describe_error

UNSWEEPABLE = ("name", "description", "sweep")


@dataclass(frozen=True)
class Case:
    """One point of a scenario's sweep, with its scenario fully resolved."""

    case_id: str
    index: int
    params: dict[str, Any]
    scenario: Scenario
    label_text: str = ""  # set by ``expand_cases`` from every case of the sweep

    def model_args(self) -> ModelArgs:
        return self.scenario.model_args()

    def requests(self) -> list[RequestSpec]:
        return self.scenario.requests()

    def engine_config(self) -> EngineConfig:
        """The case's complete engine configuration, resolved once (the kernels' environment
        default is read then): every later read of the case sees the same settings."""
        return self._engine_config

    @functools.cached_property
    def _engine_config(self) -> EngineConfig:
        return self.scenario.engine_config()

    def trim_threshold(self) -> int:
        return self.engine_config().trim_threshold

    def num_requests(self) -> int:
        """The step's requests; a prompt case's: its prompts and the decode rows beside them."""
        prompts = sum(1 + p.decodes_beside for p in self.scenario.workload.prompts)
        return prompts + len(self.requests())

    def num_tokens(self) -> int:
        """The step's rows; a prompt case's: its prompts' tokens."""
        prompts = sum(p.length for p in self.scenario.workload.prompts)
        return prompts + sum(r.query_len for r in self.requests())

    def label(self) -> str:
        """``graph_mode/policy/T=<tokens>`` plus what else the sweep varies, as far as it tells
        this case from the others (``case_labels``, decided once over the whole sweep)."""
        return self.label_text or _prefix(self)

    def matches(self, select: str) -> bool:
        """``--select``/``-k``: the text appears in the label or the case id."""
        return select in self.label() or select in self.case_id


@dataclass(frozen=True)
class _Axis:
    """Axis values that move together: one grid key, or one zip group."""

    where: Loc                       # ("sweep", "grid") or ("sweep", "zip", k)
    paths: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]


def case_id(params: dict[str, Any]) -> str:
    """Stable across runs and machines: a hash of the swept values only."""
    if not params:
        return "base"
    blob = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def count_cases(scenario: Scenario) -> int:
    """How many cases the sweep names, without expanding it."""
    return math.prod(len(a.rows) for a in _axes(scenario))


def expand_cases(scenario: Scenario, max_cases: int | None = None) -> list[Case]:
    """The cases of ``scenario``: the grid's product crossed with every zip group, in file order.

    The product is counted first and refused above ``max_cases`` (default: the scenario's own
    cap). Raises ScenarioError naming the sweep entry (and value) at fault; the file is
    ``scenario.source_path``.
    """
    axes = _axes(scenario)
    cap = scenario.max_cases if max_cases is None else max_cases
    count = math.prod(len(a.rows) for a in axes)
    if count > cap:
        sizes = " x ".join(str(len(a.rows)) for a in axes)
        raise ScenarioError(scenario.source_path, "sweep",
                            f"expands to {sizes} = {count} cases, above the cap of {cap}; "
                            "shrink the sweep or raise the cap with --max-cases",
                            line_of(scenario.source_text, ("sweep",)))
    base = scenario.model_dump(mode="python", exclude={"sweep"})
    cases = []
    for index, picks in enumerate(itertools.product(*(range(len(a.rows)) for a in axes))):
        data = copy.deepcopy(base)
        params: dict[str, Any] = {}
        for axis, row in zip(axes, picks, strict=True):
            for path, value in zip(axis.paths, axis.rows[row], strict=True):
                _assign(data, path.split("."), copy.deepcopy(value))
                params[path] = value
        resolved = _resolve(scenario, data, axes, picks, params)
        cases.append(Case(case_id(params), index, params, resolved))
    return [dataclasses.replace(c, label_text=label)
            for c, label in zip(cases, case_labels(cases), strict=True)]


def case_labels(cases: list[Case]) -> list[str]:
    """One readable label per case, unique within the sweep.

    Each starts ``graph_mode/policy/T=<tokens>`` and shows, in file order, every other swept
    value outside the workload (``key=value``). A swept workload path is shown only where it
    tells apart cases whose labels so far are equal (T sums most workload changes up; not one
    that keeps the token count: other requests, chunks or prefix hits of the same total), a
    structured value as the requests it makes. A path left out is constant over every final
    group, so cases that still share a label differ only in values rendered alike (two
    workloads of the same requests): they get their case id.
    """
    labels = [_prefix(c) for c in cases]
    if not cases:
        return labels
    paths = [p for p in cases[0].params if p not in ("graph_mode", "policy")]
    leaves = [p.rsplit(".", 1)[-1] for p in paths]
    for path, leaf in zip(paths, leaves, strict=True):
        seen: dict[str, set[str]] = {}
        for label, c in zip(labels, cases, strict=True):
            seen.setdefault(label, set()).add(json.dumps(c.params[path], sort_keys=True,
                                                         default=str))
        if path.startswith("workload.") and all(len(v) == 1 for v in seen.values()):
            continue
        key = leaf if leaves.count(leaf) == 1 else path
        labels = [f"{label}/{_part(c, path, key)}" for label, c in zip(labels, cases, strict=True)]
    counts = Counter(labels)
    return [f"{label}#{c.case_id}" if counts[label] > 1 else label
            for label, c in zip(labels, cases, strict=True)]


def _prefix(case: Case) -> str:
    """``graph_mode/policy/T=<tokens>``; a prompt case's T is its prompts' tokens, in the chunks
    it names (``chunks=<size>[+<decode rows beside>d]``)."""
    s = case.scenario
    parts = [s.graph_mode, s.policy, f"T={case.num_tokens()}"]
    if s.workload.prompts:
        parts.append("chunks=" + ",".join(
            f"{p.chunk_size}" + (f"+{p.decodes_beside}d" if p.decodes_beside else "")
            for p in s.workload.prompts))
    return "/".join(parts)


def _part(case: Case, path: str, key: str) -> str:
    """``key=value``; a structured workload value (requests, an entry, a generator) as the
    requests it makes (``describe_requests``), keyed by its path inside the workload."""
    value = case.params[path]
    if path.startswith("workload.") and isinstance(value, dict | list):
        node = _node(case.scenario, path.split("."))
        items = node if isinstance(node, list) else [node]
        if all(hasattr(item, "specs") for item in items):
            specs = [spec for item in items for spec in item.specs(case.model_args().window)]
            return f"{path.removeprefix('workload.')}={describe_requests(specs)}"
        key = path.removeprefix("workload.")
    return f"{key}={_compact(value)}"


def _node(node: Any, parts: list[str]) -> Any:
    for part in parts:
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


def describe_requests(specs: list[RequestSpec]) -> str:
    """Requests in a label's words: ``240of300`` a chunk of a 300-token prompt, ``240+60`` 60
    rows after 240 in the caches, ``dec@20`` a decode row after 20 (``dec@20+3v`` with three
    verify rows), ``hit12:4+26`` a prefix hit of 12 recomputed from 4, ``lp`` prompt logprobs,
    ``cl`` context logits, ``3x`` three alike in a row; comma-separated."""
    items = []
    for r in specs:
        if r.decode:
            text = f"dec@{r.context_len}"
            text += f"+{r.spec_decode_tokens}v" if r.spec_decode_tokens else ""
        else:
            text = f"{r.context_len}+{r.query_len}" if r.context_len else str(r.query_len)
            if r.recomputed_rows:
                text = f"hit{r.filled_len}:{text}"
            if r.seq_len < r.prompt_len:
                text += f"of{r.prompt_len}"
        items.append(text + ("lp" if r.prompt_logprobs else "") + ("cl" if r.context_logits
                                                                   else ""))
    runs = [(item, len(list(group))) for item, group in itertools.groupby(items)]
    return ",".join(f"{n}x{item}" if n > 1 else item for item, n in runs) or "none"


def _compact(value: Any) -> str:
    """A swept value without JSON's quotes and braces: strings bare, mappings ``k=v,...``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ",".join(f"{k}={_compact(v)}" for k, v in value.items())
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return "[" + ";".join(_compact(v) for v in value) + "]"
    return _show(value)


def _resolve(
    scenario: Scenario, data: dict, axes: list[_Axis], picks: tuple[int, ...],
    params: dict[str, Any],
) -> Scenario:
    try:
        resolved = Scenario.model_validate(data)
    except ValidationError as err:
        loc, message = describe_error(err.errors()[0])
    else:
        problems = resolved.bind_source(scenario.source_path, scenario.source_text).problems()
        if not problems:
            return resolved
        loc, message = problems[0]
    raise _case_error(scenario, loc, message, axes, picks, params)


def _case_error(
    scenario: Scenario, loc: Loc, message: str, axes: list[_Axis], picks: tuple[int, ...],
    params: dict[str, Any],
) -> ScenarioError:
    """Blame the sweep value when the bad field is (inside) a swept path, else the field itself
    with the case's sweep values appended."""
    file, text = scenario.source_path, scenario.source_text
    target = tuple(str(part) for part in loc)
    for axis, row in zip(axes, picks, strict=True):
        for path, value in zip(axis.paths, axis.rows[row], strict=True):
            parts = tuple(path.split("."))
            if target[:len(parts)] != parts:
                continue
            inner = f"{dotted(loc)}: " if target != parts else ""
            field = f"{dotted(axis.where)}.{path}"
            return ScenarioError(file, field, f"value {_show(value)}: {inner}{message}",
                                 line_of(text, (*axis.where, path, row)))
    context = ", ".join(f"{path}={_show(value)}" for path, value in params.items())
    return located(file, text, loc, f"{message} (in sweep case {context})" if context else message)


def _axes(scenario: Scenario) -> list[_Axis]:
    sweep: Sweep = scenario.sweep
    axes = [_Axis(("sweep", "grid"), (path,), tuple((v,) for v in values))
            for path, values in sweep.grid.items()]
    for k, group in enumerate(sweep.zip):
        where: Loc = ("sweep", "zip", k)
        lengths = {path: len(values) for path, values in group.items()}
        first = next(iter(group))
        for path, n in lengths.items():
            if n != lengths[first]:
                raise _sweep_error(scenario, (*where, path), f"has {n} values but {first} has "
                                   f"{lengths[first]}; zipped lists move together")
        rows = tuple(zip(*group.values(), strict=True))
        axes.append(_Axis(where, tuple(group), rows))

    seen: dict[str, Loc] = {}
    for axis in axes:
        for path in axis.paths:
            problem = _path_problem(scenario, path)
            if problem is None:
                problem = next((f"overlaps {dotted((*where, other))}"
                                for other, where in seen.items()
                                if _overlaps(path, other)), None)
            if problem is not None:
                raise _sweep_error(scenario, (*axis.where, path), problem)
            seen[path] = axis.where
        keys: set[str] = set()
        for row, values in enumerate(axis.rows):
            key = json.dumps(values, sort_keys=True, default=str)
            if key in keys:
                value = values if len(axis.paths) > 1 else values[0]
                raise _sweep_error(scenario, (*axis.where, axis.paths[0], row),
                                   f"duplicate value {_show(value)}: cases would repeat")
            keys.add(key)
    return axes


def _sweep_error(scenario: Scenario, loc: Loc, message: str) -> ScenarioError:
    """``loc`` is ``(*axis.where, path[, row])``; the field named is ``sweep.<...>.<path>``."""
    return ScenarioError(scenario.source_path, dotted(loc[:4] if loc[1] == "zip" else loc[:3]),
                         message, line_of(scenario.source_text, loc))


def _overlaps(a: str, b: str) -> bool:
    pa, pb = a.split("."), b.split(".")
    n = min(len(pa), len(pb))
    return pa[:n] == pb[:n]


def _path_problem(scenario: Scenario, path: str) -> str | None:
    """Why ``path`` names nothing sweepable in ``scenario`` (None when it does)."""
    parts = path.split(".")
    if parts[0] in UNSWEEPABLE:
        return f"{parts[0]} cannot be swept"
    node: Any = scenario
    for depth, part in enumerate(parts):
        here = ".".join(parts[:depth]) or "the scenario"
        if isinstance(node, BaseModel):
            if part not in type(node).model_fields:
                fields = ", ".join(f for f in type(node).model_fields if f not in UNSWEEPABLE)
                return f"{here} has no field {part!r}; expected one of: {fields}"
            node = getattr(node, part)
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                return f"{here} has no item {part!r} (it has {len(node)})"
            node = node[int(part)]
        elif parts[:depth] == ["model", "overrides"]:
            if part not in MODEL_FIELDS:
                return f"{part!r} is not a model field"
            if depth != len(parts) - 1:
                return f"model.overrides.{part} is a value with no fields"
            return None
        else:
            return f"{here} is a value with no field {part!r}"
    return None


def _assign(data: Any, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        data = data[int(part)] if isinstance(data, list) else data[part]
    last = parts[-1]
    if isinstance(data, list):
        data[int(last)] = value
    else:
        data[last] = value


def _show(value: Any) -> str:
    return json.dumps(value, default=str)
