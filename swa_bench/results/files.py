"""A run's results files: atomic writes, and reading results.json with one-line refusals.

A write goes to a temp file beside its target and is moved over it once synced, so a reader sees
the old file or the new one, never a torn one. A read refuses, in one line naming the file (and
the field), what is not a regular file, not strict JSON, not this schema version or not the schema.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pydantic import ValidationError

from swa_bench.results.frame import results_frame
from swa_bench.results.schema import READABLE_VERSIONS, SCHEMA_VERSION, RunResults

RESULTS_JSON = "results.json"
RESULTS_CSV = "results.csv"
# A results file larger than this is refused unread: a 69 MB one took 24 s and 2.3 GB to parse,
# where a 1000-case sweep (the expansion cap) writes about 10 MB.
MAX_RESULTS_BYTES = 64 * 1024**2
# What a run folder holds: `run --overwrite` deletes these, compare and export never replace them.
RUN_OUTPUT_FILES = (RESULTS_JSON, RESULTS_CSV, "report.md", "report.html", "junit.xml",
                    "compare.md")


class ResultsError(ValueError):
    """A results file that is missing or invalid; `str()` is one line: `FILE: field: message`."""

    def __init__(self, file: str | Path, field: str | None, message: str) -> None:
        self.file = str(file)
        self.field = field
        self.message = " ".join(message.split())
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.field:
            return f"{self.file}: {self.field}: {self.message}"
        return f"{self.file}: {self.message}"


def is_stream(path: str | Path) -> bool:
    """Whether `path` is an existing character device or FIFO (/dev/null, /dev/stdout, a named
    pipe): such a target is written in place, as renaming a file over it would replace the node."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def _refuse_device(path: Path) -> None:
    """A block device or socket is neither a file to replace nor a stream to write into: writing
    a disk's device node would overwrite the disk."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        raise OSError(errno.EINVAL, "is a block device or socket, not a file", str(path))


@contextmanager
def atomic_writer(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """Open a temp file beside `path`, and move it over `path` only once fully written and synced.

    Readers see the old file or the new one, never a torn one, and a failure leaves `path` as it was
    and no temp file behind (os.replace is atomic within one directory). A symlink to a file in
    the same folder keeps pointing at it, one out of the folder is refused (`_contained`), and a
    stream (`is_stream`) is written directly: nothing to tear there."""
    kwargs = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    if is_stream(path):
        with open(path, mode, **kwargs) as handle:
            yield handle
        return
    path = _contained(Path(path))
    _refuse_device(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _contained(path: Path) -> Path:
    """``path`` resolved, where a symlink stays inside the folder being written: one pointing
    elsewhere (``ln -s ~/victim DIR/report.md``) would let whoever can write a run folder replace
    any file the tool can, so it is refused (OSError, ELOOP) rather than followed."""
    resolved = Path(os.path.realpath(path))
    if path.is_symlink() and resolved.parent != Path(os.path.realpath(path.parent)):
        raise OSError(errno.ELOOP, f"is a symlink to {resolved}, outside its folder; refusing "
                      "to write through it", str(path))
    return resolved


def write_text_atomic(path: Path, text: str) -> Path:
    with atomic_writer(path) as handle:
        handle.write(text)
    return Path(path)


def save_results(run_dir: str | Path, results: RunResults) -> tuple[Path, Path]:
    """Write results.json and results.csv into `run_dir`, each atomically; returns both paths."""
    run_dir = Path(run_dir)
    json_path = write_text_atomic(run_dir / RESULTS_JSON, results.model_dump_json(indent=2) + "\n")
    csv_path = run_dir / RESULTS_CSV
    with atomic_writer(csv_path) as handle:
        results_frame(results).to_csv(handle, index=False)
    return json_path, csv_path


def refuse_run_output(path: str | Path, option: str, *, own: str | None = None) -> None:
    """Raise ResultsError when `path` (or what it links to) is an output file of a run folder (a
    folder holding a results.json): an export or a comparison written there would replace that
    run's results or reports. `own` is the one name the caller writes into run folders itself."""
    path = Path(path)
    for candidate in (path, path.resolve()):
        if (candidate.name in RUN_OUTPUT_FILES and candidate.name != own
                and (candidate.parent / RESULTS_JSON).is_file()):
            raise ResultsError(path, option, f"is the {candidate.name} of the run folder "
                               f"{candidate.parent}: refusing to replace a run's output "
                               "(write it elsewhere)")


def results_path(path_or_run_dir: str | Path) -> Path:
    path = Path(path_or_run_dir)
    return path / RESULTS_JSON if path.is_dir() else path


def load_results(path_or_run_dir: str | Path) -> RunResults:
    """Read a run's results.json (given the file or its run dir); raises ResultsError."""
    path = results_path(path_or_run_dir)
    if path.exists() and not path.is_file():  # a FIFO blocks the read, /dev/zero never ends
        raise ResultsError(path, None, "is not a regular file (a device, pipe or socket)")
    try:
        size = path.stat().st_size
        if size > MAX_RESULTS_BYTES:
            raise ResultsError(path, None, f"is {size / 1024**2:.0f} MiB, larger than the "
                               f"{MAX_RESULTS_BYTES // 1024**2} MiB a results file may be")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(path, None,
                           "no such file (expected a run dir or a results.json)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(path, None, f"cannot read: {exc}") from None
    if not text.strip():
        raise ResultsError(path, None, "empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(path, None, f"invalid JSON: {exc.msg} (line {exc.lineno})") from None
    except RecursionError:
        raise ResultsError(path, None, "invalid results: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ResultsError(path, None, f"top level must be an object, not {type(data).__name__}")
    version = data.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int or version not in READABLE_VERSIONS:  # True == 1 in Python
        raise ResultsError(path, "schema_version", f"unsupported version {version!r} "
                           f"(this swa-bench reads {', '.join(map(str, READABLE_VERSIONS))})")
    try:
        return RunResults.model_validate(data)
    except RecursionError:
        raise ResultsError(path, None, "invalid results: JSON nested too deeply") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        more = exc.error_count() - 1
        suffix = f" (and {more} more error{'s' if more > 1 else ''})" if more else ""
        raise ResultsError(path, field, f"{first['msg']}{suffix}") from None
