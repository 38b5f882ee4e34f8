"""The one error type for bad scenario input, and where in the file an error is."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

Loc = tuple[str | int, ...]
StrLoc = tuple[str, ...]


class ScenarioError(ValueError):
    """A scenario problem a user can fix, rendered as ONE line: ``FILE: path.to.field: message``.

    ``field`` is empty for file-level problems (missing, unreadable, not YAML); ``line`` is the
    1-based YAML line when it is known. The CLI prints ``str(err)`` and exits 2.
    """

    def __init__(
        self, file: str | Path | None, field: str, message: str, line: int | None = None
    ) -> None:
        self.file = str(file) if file is not None else "<scenario>"
        self.field = field
        self.message = " ".join(str(message).split())
        self.line = line
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.file}: {self.field}: " if self.field else f"{self.file}: "
        suffix = f" (line {self.line})" if self.line is not None else ""
        return f"{where}{self.message}{suffix}"


def dotted(loc: Loc) -> str:
    """``("workload", "requests", 0, "prompt_len")`` -> ``workload.requests.0.prompt_len``;
    a sweep zip group renders as ``sweep.zip[k]``, the form its errors are documented in."""
    out = ""
    for i, part in enumerate(loc):
        if i >= 2 and loc[i - 2:i] == ("sweep", "zip"):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


@lru_cache(maxsize=16)
def yaml_index(text: str) -> tuple[dict[StrLoc, int], tuple[tuple[StrLoc, int], ...]]:
    """Maps each key / list item of a YAML document to its 1-based line, and lists duplicate keys
    with their lines (``yaml.safe_load`` silently keeps the last one)."""
    lines: dict[StrLoc, int] = {}
    duplicates: list[tuple[StrLoc, int]] = []
    seen: set[int] = set()

    def walk(node: yaml.Node, loc: StrLoc) -> None:
        if id(node) in seen:  # an alias: its keys were indexed (and checked) at the anchor
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*loc, str(key.value))
                if child in lines:
                    duplicates.append((child, key.start_mark.line + 1))
                else:
                    lines[child] = key.start_mark.line + 1
                walk(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[(*loc, str(i))] = item.start_mark.line + 1
                walk(item, (*loc, str(i)))

    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        root = None
    if root is not None:
        walk(root, ())
    return lines, tuple(duplicates)


def line_of(text: str, loc: Loc) -> int | None:
    """The line of ``loc``, else of its closest ancestor in the file (a missing key's parent)."""
    lines = yaml_index(text)[0]
    key = tuple(str(part) for part in loc)
    while key:
        if key in lines:
            return lines[key]
        key = key[:-1]
    return None


def located(file: str | Path | None, text: str, loc: Loc, message: str) -> ScenarioError:
    return ScenarioError(file, dotted(loc), message, line_of(text, loc))
