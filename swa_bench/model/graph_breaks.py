"""Eager-break sites: the places where a PIECEWISE graph ends a segment and runs code eagerly.

The model marks its break sites (attention, whose shapes follow the step's metadata); the graph
capture in ``swa_bench.graphs`` installs the handler that turns a call into a break while it
records. Outside a capture a marked function is a plain call. The model defines the marker and
the capture supplies the behaviour, so the model never imports the graph code.

A second marker, ``host_effect``, names code inside a captured stretch whose effect is on host
state that later eager breaks read (S's publications put into the replay batch's forward context):
Python does not run at a graph replay, so the capture records the call and every replay redoes it
after the segment it was met in, without ending that segment.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class BreakHandler(Protocol):
    """What a capture does with a marked call: ``on_break`` for an eager break, ``on_host_effect``
    for a host effect; each runs the call and records what a replay must redo."""

    def on_break(self, site: str, fn: Callable[..., Any], args: tuple, writes_out: bool) -> Any:
        ...

    def on_host_effect(self, site: str, fn: Callable[..., Any], args: tuple) -> Any: ...


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


def eager_break(site: str, *, writes_out: bool = False) -> Callable[[Callable], Callable]:
    """Marks a function as an eager-break site named ``site``. ``writes_out``: the function
    takes a keyword ``out`` (None: it allocates; else its output's buffers, a tensor or a tuple
    as it returns) and writes its outputs there, returning them, so a graph replay hands it the
    break's fixed buffers instead of copying fresh outputs into them (attention's heads: 1 GB
    a layer at 16K tokens)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            if _handler is None:
                return fn(*args)
            return _handler.on_break(site, fn, args, writes_out)

        return wrapper

    return decorate


def host_effect(site: str) -> Callable[[Callable], Callable]:
    """Marks a function whose effect is on host state (a forward context's fields) as ``site``:
    a capture records it and each replay calls it again with the same arguments."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any) -> Any:
            if _handler is None:
                return fn(*args)
            return _handler.on_host_effect(site, fn, args)

        return wrapper

    return decorate
