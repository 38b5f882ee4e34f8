"""Breakable capture: one forward recorded as graph segments separated by eager breaks.

One capture drives the whole forward. At an eager break the current segment ends, the break's
function runs eagerly and its outputs are copied into fixed buffers, and the next segment begins
reading those buffers. Replay runs the recorded segments in order and calls each break's function
again with the same (static) argument tensors, so a break may look at the step's metadata through
the forward context while everything captured stays frozen.

Segments are real ``torch.cuda.CUDAGraph`` captures sharing one memory pool on a GPU, and tapes of
ATen ops (``standin.TapeSegment``) on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from swa_bench.model.graph_breaks import break_handler


class Segment(Protocol):
    def begin(self) -> None: ...
    def end(self) -> None: ...
    def replay(self) -> None: ...


class CudaSegment:
    """A CUDA graph segment; all segments of all sizes share ``pool``."""

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def begin(self) -> None:
        self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()


class BreakBuffers:
    """Fixed output buffers of the eager breaks, one per (site, output), allocated once.

    The largest size is captured first, so the first allocation fits every later capture; views
    of the same buffers serve every size, so their ``data_ptr`` never changes.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}

    def views(self, site: str, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        views = []
        for i, out in enumerate(outputs):
            buf = self.buffers.get((site, i))
            if buf is None:
                buf = self.buffers[(site, i)] = torch.empty_like(out)
            if buf.shape[1:] != out.shape[1:] or buf.shape[0] < out.shape[0]:
                raise RuntimeError(
                    f"break {site!r} output {i} of shape {tuple(out.shape)} does not fit its "
                    f"buffer "
                    f"{tuple(buf.shape)}: capture the largest size first"
                )
            views.append(buf[: out.shape[0]])
        return tuple(views)


Bindings = dict[int, torch.Tensor]  # id of a tensor given at capture -> the one to use instead


def _bound(args: tuple, bindings: Bindings | None) -> tuple:
    if not bindings:
        return args
    return tuple(bindings.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)


class _Break:
    """An eager break: at each replay ``fn`` runs on the capture's arguments and its outputs
    land in the fixed buffers the next segment reads, written there by ``fn`` itself where its
    site ``writes_out`` (no copy), else copied."""

    def __init__(self, fn: Callable, args: tuple, outputs: tuple[torch.Tensor, ...],
                 writes_out: bool, single: bool) -> None:
        self.fn, self.args, self.outputs, self.writes_out = fn, args, outputs, writes_out
        self.single = single  # ``fn`` returns one tensor, not a tuple

    def replay(self, bindings: Bindings | None = None) -> None:
        args = _bound(self.args, bindings)
        if self.writes_out:
            out = self.outputs[0] if self.single else self.outputs
            got = _as_tuple(self.fn(*args, out=out))
            if len(got) != len(self.outputs) or any(
                    g is not b for g, b in zip(got, self.outputs, strict=False)):
                raise RuntimeError(f"{self.fn.__name__} was given out= and returned other "
                                   "tensors: its site must not be marked writes_out")
            return
        out = _as_tuple(self.fn(*args))
        for buf, fresh in zip(self.outputs, out, strict=True):
            buf.copy_(fresh)


class _HostEffect:
    """A ``host_effect`` call met inside a segment: redone after that segment at each replay."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args

    def replay(self, bindings: Bindings | None = None) -> None:
        self.fn(*_bound(self.args, bindings))


class SegmentedCapture:
    """One padded size's graph: its pieces (segments and breaks) in the order the forward met them.

    While it records it is the model's break handler (``model.graph_breaks``): a marked call ends
    the open segment, runs eagerly, and the next segment begins (FULL captures run it inline); a
    host effect runs and is replayed after the segment it was met in.

    ``run(bindings)`` hands a break the tensor bound to one of its capture-time arguments instead
    of that argument: an input the segments never read but a break does (the replay graph's batch
    KV, whose row count is the step's, not the graph's) needs no static buffer.
    """

    def __init__(
        self, new_segment: Callable[[], Segment], buffers: BreakBuffers, *, breaks: bool
    ) -> None:
        self.new_segment = new_segment
        self.buffers = buffers
        self.breaks = breaks
        self.pieces: list[Segment | _Break | _HostEffect] = []
        self.outputs: Any = None
        self._open: Segment | None = None
        self._effects: list[_HostEffect] = []  # met in the open segment
        self.in_break = False  # breaks met while a break runs eagerly run inline

    @property
    def num_segments(self) -> int:
        return sum(not isinstance(s, (_Break, _HostEffect)) for s in self.pieces)

    @property
    def num_breaks(self) -> int:
        return sum(isinstance(s, _Break) for s in self.pieces)

    def capture(self, fn: Callable[[], Any]) -> Any:
        with break_handler(self):
            try:
                self._begin()
                self.outputs = fn()
                self._end()
            except BaseException:
                if self._open is not None:
                    segment, self._open = self._open, None
                    try:
                        segment.end()  # leave stream capture; the original error is what matters
                    except Exception:
                        pass
                raise
        return self.outputs

    def run(self, bindings: Bindings | None = None) -> Any:
        """Replays the recorded pieces in order; returns the forward's (static) outputs."""
        for piece in self.pieces:
            if isinstance(piece, (_Break, _HostEffect)):
                piece.replay(bindings)
            else:
                piece.replay()
        return self.outputs

    def on_break(self, site: str, fn: Callable, args: tuple, writes_out: bool = False) -> Any:
        if not self.breaks or self.in_break:
            return fn(*args)
        return self._break_out(site, fn, args, writes_out)

    def on_host_effect(self, site: str, fn: Callable, args: tuple) -> Any:
        result = fn(*args)
        if not self.in_break:  # inside a break it reruns with the break
            self._effects.append(_HostEffect(fn, args))
        return result

    def _break_out(self, site: str, fn: Callable, args: tuple, writes_out: bool) -> Any:
        self._end()
        self.in_break = True
        try:
            result = fn(*args)  # a fresh output: the first capture sizes the buffers from it
        finally:
            self.in_break = False
        outputs = self.buffers.views(site, _as_tuple(result))
        for buf, out in zip(outputs, _as_tuple(result), strict=True):
            buf.copy_(out)
        single = not isinstance(result, (tuple, list))
        self.pieces.append(_Break(fn, args, outputs, writes_out, single))
        self._begin()
        return outputs if isinstance(result, tuple) else outputs[0]

    def _begin(self) -> None:
        self._open = self.new_segment()
        self._open.begin()

    def _end(self) -> None:
        segment, self._open = self._open, None
        segment.end()
        self.pieces.append(segment)
        self.pieces += self._effects
        self._effects = []


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
