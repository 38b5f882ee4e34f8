"""Eager-break sites: the places where a PIECEWISE graph ends a segment and runs code eagerly.

The model marks its break sites (attention, whose shapes follow the step's metadata); the graph
capture in ``swa_bench.graphs`` installs the handler that turns a call into a break while it
records. Outside a capture a marked function is a plain call. The model defines the marker and
the capture supplies the behaviour, so the model never imports the graph code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class BreakHandler(Protocol):
    def __call__(self, site: str, fn: Callable[..., Any], args: tuple) -> Any: ...


_handler: BreakHandler | None = None


@contextlib.contextmanager
def break_handler(handler: BreakHandler) -> Iterator[None]:
    """Routes every marked call to ``handler`` for the duration (one capture at a time)."""
    global _handler
    if _handler is not None:
        raise RuntimeError("captures do not nest")
    _handler = handler
    try:
        yield
    finally:
        _handler = None


def eager_break(site: str) -> Callable[[Callable], Callable]:
    """Marks a function as an eager-break site named ``site``."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            if _handler is None:
                return fn(*args)
            return _handler(site, fn, args)

        return wrapper

    return decorate
