"""Capturing a model's forward once per capture size, in PIECEWISE or FULL mode.

Capture discipline (SPEC section 4): an eager warm-up first, the largest size first, one memory
pool and one set of break buffers shared by every size, and dummy batches whose rows write nothing
(slot -1), so capture never touches the caches. PIECEWISE captures break at every eager-break site
the forward meets (attention; the replay layers when the step plan of that size replays); FULL
captures hold the whole forward.

This module is mechanism only: the engine plans each dummy batch and each step and hands over the
forward context to capture or replay under. A graph's segments hold the cache tensors of the
context it was captured under, so the graphs are bound to one cache (the engine's): a context on
any other cache is refused at capture and at replay, never replayed onto the wrong cache.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from swa_bench.graphs.breakable import BreakBuffers, CudaSegment, SegmentedCapture
from swa_bench.graphs.capture_sizes import check_capture_sizes
from swa_bench.graphs.standin import TapeSegment
from swa_bench.model.batch import StepBatch, build_step
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ForwardContext, set_forward_context
from swa_bench.model.model import ModelOutput, Transformer

CaptureMode = Literal["piecewise", "full"]


@dataclass
class CaptureStats:
    seconds: float = 0.0
    pool_bytes: int = 0  # device memory the graphs hold (CUDA only): ``held_bytes``' growth
    segments: int = 0
    breaks: int = 0


def held_bytes(device: torch.device) -> int:
    """Device memory this process's allocator holds once its unused cache is released: what a
    capture adds to it (graph pools, static and break buffers) is what the graphs cost, neither
    counting nor, once the warm-up's cache is released (``record``), subtracting memory that
    was merely cached. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def record(capture: SegmentedCapture, fn: Callable[[], object], device: torch.device) -> None:
    """``fn`` run once eagerly (the warm-up), then recorded into ``capture``: on a side stream
    on a GPU, as CUDA graph capture requires, synchronised on both sides.

    The warm-up's activations go back to the caching allocator's general pool, which a graph's
    private pool cannot draw on: left cached, a graph of 64K v41-flash tokens needs its
    activations twice over (29 GB cached beside the capture's own when it ran out of memory,
    issue 34), so they are released before the capture."""
    fn()
    if device.type != "cuda":
        capture.capture(fn)
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        capture.capture(fn)
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


class CapturedGraphs:
    """The graphs of one model, one mode and one cache: a segmented capture and a static batch per
    size."""

    def __init__(
        self, model: Transformer, mode: CaptureMode, capture_sizes: Sequence[int], logit_slots: int,
        cache: KVCache,
    ) -> None:
        check_capture_sizes(capture_sizes)
        self.model, self.mode, self.cache = model, mode, cache
        self.capture_sizes = list(capture_sizes)
        self.logit_slots = logit_slots
        self.device = model.embed.weight.device
        self.on_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.on_cuda else None
        self.buffers = BreakBuffers()
        self.graphs: dict[int, SegmentedCapture] = {}
        self.static_steps: dict[int, StepBatch] = {}
        self.stats = CaptureStats()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture_all(self, context_for: Callable[[StepBatch, int], ForwardContext]) -> None:
        """Captures every size, largest first; ``context_for(dummy step, size)`` is the context
        the engine plans for it. A failed capture keeps no partial set."""
        start = time.perf_counter()
        before = held_bytes(self.device)
        try:
            with torch.inference_mode():
                for size in sorted(self.capture_sizes, reverse=True):
                    self._capture(size, context_for)
        except BaseException:
            self.graphs.clear()
            self.static_steps.clear()
            raise
        self.stats.pool_bytes = held_bytes(self.device) - before
        self.stats.seconds = time.perf_counter() - start
        self.stats.segments = sum(g.num_segments for g in self.graphs.values())
        self.stats.breaks = sum(g.num_breaks for g in self.graphs.values())

    def _capture(self, size: int, context_for: Callable[[StepBatch, int], ForwardContext]) -> None:
        static = build_step(
            [], [], [], self.model.args, self.device, pad_to=size, logit_slots=self.logit_slots,
            writes=False,
        )
        static.metadata.derived = None  # steps overwrite its buffers: nothing derived is kept
        capture = SegmentedCapture(
            functools.partial(CudaSegment, self.pool) if self.on_cuda else TapeSegment,
            self.buffers,
            breaks=self.mode == "piecewise",
        )
        with set_forward_context(self._bound(context_for(static, size))):
            record(capture, lambda: self.model(static.input_ids), self.device)
        self.graphs[size] = capture
        self.static_steps[size] = static

    def load(self, step: StepBatch, size: int) -> StepBatch:
        """``step`` (padded to ``size``) copied into that graph's static buffers."""
        with torch.inference_mode():
            return step.copy_into(self.static_steps[size])

    def run(self, size: int, ctx: ForwardContext) -> ModelOutput:
        """Replays the graph of ``size`` under ``ctx`` (its eager breaks read it): the static
        (logits, streams, pre_mix, aux hidden states), valid until the next replay."""
        with torch.inference_mode(), set_forward_context(self._bound(ctx)):
            return self.graphs[size].run()

    def _bound(self, ctx: ForwardContext) -> ForwardContext:
        if ctx.cache is not self.cache:
            raise RuntimeError("a captured graph runs only on the cache it is bound to")
        return ctx
