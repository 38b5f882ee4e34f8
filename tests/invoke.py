"""The entry points run inside the test process, answering as a subprocess would.

``swa_bench`` drives the typer app through its own ``main`` (the one-line error mapping, the
``sys.exit`` codes); ``trainer`` and ``evaluator`` call the training commands' ``main``: no
interpreter start and no torch import per case. Each gives an ``Outcome`` shaped like
``CompletedProcess``, so the same assertions serve both; an exception that escapes the entry
point fails the test (it would be a traceback from the real interpreter). What needs a fresh
interpreter (a memory or time limit, signals, a closed pipe, argv of ``python -m``) stays a
subprocess in the modules that use these.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

try:  # click < 8.2 mixes stderr into stdout unless told not to
    _runner = CliRunner(mix_stderr=False)
except TypeError:
    _runner = CliRunner()


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


# A bad input must be refused in bounded time: a case that hangs (a pipe read, an expansion
# that never ends) fails its test after this long instead of stalling the whole session. The
# subprocess tests bound memory too; in-process cases are the ones refused before allocating.
TIME_LIMIT_S = 60


class TookTooLong(Exception):
    pass


@contextlib.contextmanager
def _inside(cwd: Path | None) -> Iterator[None]:
    """Run from ``cwd`` under ``TIME_LIMIT_S`` (SIGALRM: the main thread, as pytest runs)."""
    before = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)

    def expire(signum, frame):
        raise TookTooLong(f"not refused within {TIME_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        os.chdir(before)


def swa_bench(*args: str, cwd: Path | None = None,
              env: Mapping[str, str] | None = None) -> Outcome:
    """``swa-bench ARGS`` in this process, run from ``cwd`` with ``env`` added to the
    environment, at 80 columns as the subprocess tests run it."""
    from swa_bench.cli import app

    with _inside(cwd):
        result = _runner.invoke(app, list(args), prog_name="swa-bench",
                                env={"COLUMNS": "80", **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"swa-bench {' '.join(args)} raised") from result.exception
    return Outcome(result.exit_code, result.stdout, result.stderr)


def trainer(cwd: Path, *argv: str) -> Outcome:
    """``python -m swa_bench.train ARGV`` in this process, run from ``cwd``."""
    from swa_bench.train.__main__ import main

    return _call(main, cwd, argv)


def evaluator(cwd: Path, *argv: str) -> Outcome:
    """``python -m swa_bench.train.evaluate ARGV`` in this process, run from ``cwd``."""
    from swa_bench.train.evaluate import main

    return _call(main, cwd, argv)


def _call(main, cwd: Path, argv: tuple[str, ...]) -> Outcome:
    out, err = io.StringIO(), io.StringIO()
    with _inside(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return Outcome(code, out.getvalue(), err.getvalue())
