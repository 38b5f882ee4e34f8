"""Run folders: where a run writes, checked and locked before any case runs.

A run must never lose or silently replace earlier results: a folder that holds another run is
refused unless the user says ``--resume`` or ``--overwrite``, two scenarios of one invocation never
share a folder, and a lock keeps two processes from writing one folder. Everything that can be
checked (the path is a folder we can create and write) is checked before any work, so bad
``--out`` values cost nothing. Errors are one line (``RunFolderError``), for exit code 2.

A refusal leaves every folder exactly as it was: the folders are judged before any lock file is
created (and again under the locks), and ``--overwrite`` deletes only once every folder is locked
and judged, so the run is certain to start.

A folder's shard files (``.shards/``, written by a ``--gpus`` sweep's workers, ``run/shards.py``)
are part of its run: each names its scenario (name and source hash), as results.json does, so a
shard of another scenario, or one that cannot be read, is refused with one line, never merged.

The lock is ``filelock`` (already installed with torch): flock on POSIX, msvcrt on Windows, released
by the kernel when a killed process dies, so a stale lock file never blocks a later run.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, ValidationError

from swa_bench.results import RESULTS_JSON, CaseResult, ResultsError, load_results
from swa_bench.results import RUN_OUTPUT_FILES as OUTPUT_FILES

LOCK_FILE = ".swa-bench.lock"
DEFAULT_ROOT = Path("reports")
SHARD_DIR = ".shards"  # a --gpus sweep's workers save their cases here (run/shards.py)
RESUME_HINT = ("delete it to resume without its cases, or pass --overwrite instead of --resume "
               "to start over")


class RunFolderError(ValueError):
    """A run folder that cannot or must not be written; ``str()`` is one line."""

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        self.message = " ".join(message.split())
        super().__init__(f"{self.path}: {self.message}")


class Interrupted(Exception):
    """Ctrl-C during a run; ``str()`` says what was kept and how to continue."""


def utc_stamp(now: dt.datetime | None = None) -> str:
    return (now or dt.datetime.now(dt.timezone.utc)).strftime("%Y%m%dT%H%M%SZ")


def plan_run_dirs(names: Sequence[str], files: Sequence[str | Path], out: Path | None, *,
                  resume: bool, stamp: str, root: Path = DEFAULT_ROOT) -> list[Path]:
    """The folder of each scenario (pure but for --resume's look for the newest earlier run).

    ``--out`` names the run folder, or with several scenarios the parent of one folder per
    scenario name; without it, ``reports/<name>-<UTC time>`` (or with --resume the newest one).
    Two scenarios with the same name would share a folder: refused.
    """
    seen: dict[str, str | Path] = {}
    for name, file in zip(names, files, strict=True):
        if name in seen:
            raise RunFolderError(file, f"has the scenario name {name!r}, like {seen[name]}; both "
                                       "would write one run folder (rename one, or run them "
                                       "one at a time with different --out folders)")
        seen[name] = file
    dirs = []
    for name in names:
        if out is not None:
            dirs.append(out / name if len(names) > 1 else out)
            continue
        previous = sorted(root.glob(f"{name}-*/{RESULTS_JSON}")) if resume else []
        dirs.append(previous[-1].parent if previous else root / f"{name}-{stamp}")
    return dirs


def check_target(path: Path, flag: str = "--out") -> None:
    """``path`` is, or can become, a folder: no file, dangling symlink, /proc-like or read-only
    folder on the way, no name longer than the file system allows (it would be found after the
    folders above it were made). Creates nothing (creating and locking is ``claim``'s job)."""
    limit = name_max(path)
    for name in path.parts:
        if len(os.fsencode(name)) > limit:
            raise RunFolderError(path, f"{flag}: a folder name of {len(os.fsencode(name))} bytes "
                                       f"({name[:16]}...) is longer than the {limit} the file "
                                       "system allows")
    try:
        for part in [path, *path.parents]:
            if part.is_symlink() and not part.exists():
                raise RunFolderError(path, f"{flag}: {part} is a symlink to missing "
                                           f"{part.readlink()}")
            if part.exists():
                if not part.is_dir():
                    what = "is a file" if part == path else f"is under {part}, which is a file"
                    raise RunFolderError(path, f"{flag}: {what}, not a folder")
                return
    except OSError as err:
        raise RunFolderError(path, f"{flag}: cannot use it ({err.strerror or err})") from None


def name_max(path: Path) -> int:
    """The longest file name (bytes) the file system holding ``path``'s nearest existing folder
    allows; 255 (Linux, macOS, NTFS) where it cannot say."""
    for part in [path, *path.parents]:
        try:
            if part.is_dir():
                return os.pathconf(part, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):
            break
    return 255


def existing_run_problem(run_dir: Path, name: str, digest: str, *, resume: bool) -> str | None:
    """Why writing scenario ``name`` (hash ``digest``) into ``run_dir`` would lose results, or
    None when it would not."""
    results_file = run_dir / RESULTS_JSON
    if not results_file.exists():
        leftovers = [f for f in OUTPUT_FILES if (run_dir / f).exists()]
        if leftovers:
            return (f"holds {', '.join(leftovers)} of an earlier run; use another --out folder "
                    "or pass --overwrite")
        shards = len(shard_files(run_dir))
        if shards and not resume:
            return (f"holds {shards} shard file(s) ({SHARD_DIR}/) of an unfinished --gpus run; "
                    "use --resume to finish it, --overwrite to discard it, or another --out "
                    "folder")
        return None
    try:
        previous = load_results(results_file)
    except ResultsError as err:
        return (f"holds a results.json that cannot be read ({err.message}); use another --out "
                "folder or pass --overwrite")
    if previous.scenario_name != name:
        return (f"holds a run of scenario {previous.scenario_name!r} "
                f"({len(previous.cases)} cases); use another --out folder or pass --overwrite")
    if not resume:
        return (f"holds a run of {name!r} ({len(previous.cases)} cases); pass --resume to "
                "continue it, --overwrite to replace it, or use another --out folder")
    if previous.scenario_hash != digest:
        return (f"holds a run of another version of {name!r}; use another --out folder or pass "
                "--overwrite")
    return None


def clean_temp_files(run_dir: Path) -> list[Path]:
    """Remove the ``.<name>.*.tmp`` files an atomic write leaves when the process is killed
    mid-write (SIGKILL skips every cleanup). Only while the folder is locked."""
    removed = []
    for name in OUTPUT_FILES:
        for tmp in run_dir.glob(f".{name}.*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _lock(run_dir: Path, stack: ExitStack) -> None:
    """Create (on failure: remove again) and lock ``run_dir``; the lock goes with ``stack``."""
    created = [p for p in [run_dir, *run_dir.parents] if not p.exists()]
    stack.callback(_remove_if_empty, created)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = FileLock(run_dir / LOCK_FILE, timeout=0)
        stack.enter_context(lock)
    except Timeout:
        raise RunFolderError(run_dir, "another swa-bench run is writing this folder; wait for "
                                      "it, or use another --out folder") from None
    except OSError as err:
        raise RunFolderError(run_dir, f"--out: cannot write here ({err.strerror or err})") from None


def _remove_if_empty(folders: list[Path]) -> None:
    """Folders this run created and left empty (bar the lock) are removed on the way out."""
    for folder in folders:
        try:
            if set(os.listdir(folder)) - {LOCK_FILE}:
                return
            (folder / LOCK_FILE).unlink(missing_ok=True)
            folder.rmdir()
        except OSError:
            return


def refuse_existing(run_dir: Path, name: str, digest: str, *, resume: bool) -> None:
    """Raise ``RunFolderError`` when writing scenario ``name`` (hash ``digest``) into ``run_dir``
    would lose results or, on --resume, merge another run's shard files (named in the error)."""
    problem = existing_run_problem(run_dir, name, digest, resume=resume)
    if problem is not None:
        raise RunFolderError(run_dir, problem)
    if resume:
        shard_results(run_dir, name, digest)


def _judge(run_dirs: Sequence[Path], names: Sequence[str], digests: Sequence[str], *,
           resume: bool, overwrite: bool) -> None:
    """Every folder refused or accepted as a whole, before anything is created or deleted."""
    if overwrite:
        return
    for run_dir, name, digest in zip(run_dirs, names, digests, strict=True):
        refuse_existing(run_dir, name, digest, resume=resume)


def discard_run(run_dir: Path) -> None:
    """``--overwrite``: the earlier run's outputs and the shard files of an unfinished one go."""
    for file in OUTPUT_FILES:
        (run_dir / file).unlink(missing_ok=True)
    clear_shards(run_dir)


@contextmanager
def claim(run_dirs: Sequence[Path], names: Sequence[str], digests: Sequence[str], *,
          resume: bool, overwrite: bool, resume_command: str) -> Iterator[list[Path]]:
    """Check, create and lock every run folder before any case runs; hold the locks for the
    run. Folders are judged before any lock file exists (a refusal changes nothing) and again
    under the locks (another run may have written meanwhile). With ``overwrite`` the earlier
    runs' files go, only once every folder is locked; temp files of a killed run always go.
    A Ctrl-C inside becomes ``Interrupted`` naming the cases kept and the command to resume."""
    for run_dir in run_dirs:
        check_target(run_dir)
    _judge(run_dirs, names, digests, resume=resume, overwrite=overwrite)
    with ExitStack() as stack:
        for run_dir in run_dirs:
            _lock(run_dir, stack)
        _judge(run_dirs, names, digests, resume=resume, overwrite=overwrite)
        for run_dir in run_dirs:
            clean_temp_files(run_dir)
            if overwrite and not resume:
                discard_run(run_dir)
        try:
            yield list(run_dirs)
        except KeyboardInterrupt:
            for run_dir in run_dirs:  # a Ctrl-C between a temp file's creation and its cleanup
                clean_temp_files(run_dir)
            raise Interrupted(interrupted_message(run_dirs, resume_command)) from None


@contextmanager
def claim_for(files: Sequence[str | Path], scenarios: Sequence, *, out: Path | None, resume: bool,
              overwrite: bool, extra_args: Sequence[str] = ()) -> Iterator[list[Path]]:
    """``claim`` for loaded scenarios: their folders, names and source hashes."""
    from swa_bench.bench.environment import scenario_hash

    names = [s.name for s in scenarios]
    run_dirs = plan_run_dirs(names, files, out, resume=resume, stamp=utc_stamp())
    with claim(run_dirs, names, [scenario_hash(s.source_text) for s in scenarios],
               resume=resume, overwrite=overwrite,
               resume_command=resume_command(files, out, run_dirs, extra_args)) as claimed:
        yield claimed


def interrupted_message(run_dirs: Sequence[Path], resume_command: str) -> str:
    """What a Ctrl-C kept: the folders holding finished cases and the command that resumes;
    before any case finished, that nothing was kept (the folders this run made go: a resume
    command would point at a folder that does not exist)."""
    kept = []
    for run_dir in run_dirs:
        try:
            cases = len(load_results(run_dir).cases)
        except ResultsError:
            cases = 0
        if cases:
            kept.append(f"{cases} finished case{'s' * (cases != 1)} in {run_dir}")
    if not kept:
        return "interrupted before any case finished: nothing was kept"
    return f"interrupted: kept {'; '.join(kept)}; continue with: {resume_command}"


def resume_command(files: Sequence[str | Path], out: Path | None, run_dirs: Sequence[Path],
                   extra: Sequence[str] = ()) -> str:
    """The command line that continues an interrupted run in the same folder(s)."""
    folder = out if out is not None else (run_dirs[0] if len(run_dirs) == 1 else None)
    args = ["swa-bench", "run", *map(str, files), *extra]
    if folder is not None:
        args += ["--out", str(folder)]
    return shlex.join([*args, "--resume"])


# --- shard files: the cases a --gpus sweep's workers finished ----------------------------------


class Shard(BaseModel):
    """One worker's file: the cases it finished and the scenario they belong to."""

    model_config = ConfigDict(extra="forbid")
    scenario_name: str
    scenario_hash: str
    cases: list[CaseResult]


def shard_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / SHARD_DIR).glob("shard-*.json"))


def shard_results(run_dir: Path, name: str, digest: str) -> list[CaseResult]:
    """Every case that workers of a sweep of scenario ``name`` (source hash ``digest``) saved.
    Raises ``RunFolderError`` naming the first shard file that cannot be read or that another
    scenario (or version) wrote: merging it would mix runs."""
    found = []
    for path in shard_files(run_dir):
        shard = read_shard(path)
        if shard.scenario_name != name:
            raise RunFolderError(path, f"holds cases of scenario {shard.scenario_name!r}, not "
                                       f"{name!r}; {RESUME_HINT}")
        if shard.scenario_hash != digest:
            raise RunFolderError(path, f"holds cases of another version of {name!r}; "
                                       f"{RESUME_HINT}")
        found += shard.cases
    return found


def read_shard(path: Path) -> Shard:
    """One shard file, or ``RunFolderError`` (one line) saying why it cannot be used."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise RunFolderError(path, f"cannot read: {err}; {RESUME_HINT}") from None
    except json.JSONDecodeError as err:
        raise RunFolderError(path, f"invalid JSON: {err.msg} (line {err.lineno}); "
                                   f"{RESUME_HINT}") from None
    except RecursionError:
        raise RunFolderError(path, f"JSON nested too deeply; {RESUME_HINT}") from None
    if not isinstance(data, dict):
        raise RunFolderError(path, f"not a shard file of this swa-bench: the top level must be "
                                   f"an object, not {type(data).__name__}; {RESUME_HINT}")
    try:
        return Shard.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise RunFolderError(path, f"not a shard file of this swa-bench: {field}: "
                                   f"{first['msg']}; {RESUME_HINT}") from None


def clear_shards(run_dir: Path) -> None:
    for path in shard_files(run_dir):
        path.unlink()
