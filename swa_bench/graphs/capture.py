"""Capturing a model's forward once per capture size, in PIECEWISE or FULL mode.

Capture discipline (SPEC section 4): an eager warm-up first, the largest size first, one memory
pool and one set of break buffers shared by every size, and dummy batches whose rows write nothing
(slot -1), so capture never touches the caches. PIECEWISE graphs break at attention and, for sizes
at or above ``trim_threshold``, around the replay layers; FULL graphs hold the whole forward, with
the static attention kernel and the decoder on the whole batch.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch

from swa_bench.bench.timing import region
from swa_bench.forward_context import BatchDescriptor, ForwardContext, set_forward_context
from swa_bench.graphs.breakable import BreakBuffers, CudaSegment, SegmentedCapture
from swa_bench.graphs.capture_sizes import check_capture_sizes
from swa_bench.graphs.standin import TapeSegment
from swa_bench.model.batch import StepBatch, build_step
from swa_bench.model.model import Transformer
from swa_bench.replay.replay_batch import ReplayBatch, build_replay_batch
from swa_bench.replay.row_selection import Policy

GraphMode = Literal["piecewise", "full"]


@dataclass
class CaptureStats:
    seconds: float = 0.0
    pool_bytes: int = 0  # device memory the graphs hold (CUDA only)
    segments: int = 0
    breaks: int = 0


@contextmanager
def replay_threshold(model: Transformer, trim_threshold: int | None):
    """Sets the replay layers' threshold for one capture; graphs freeze the decision."""
    previous = model.replay_layers.trim_threshold
    model.replay_layers.trim_threshold = trim_threshold
    try:
        yield
    finally:
        model.replay_layers.trim_threshold = previous


class CapturedGraphs:
    """The graphs of one model, one cache and one mode: a segmented capture per size."""

    def __init__(
        self,
        model: Transformer,
        mode: GraphMode,
        capture_sizes: Sequence[int],
        *,
        policy: Policy,
        trim_threshold: int | None,
        logit_slots: int,
        halo_align: int = 1,
    ) -> None:
        check_capture_sizes(capture_sizes)
        if (
            mode == "piecewise"
            and trim_threshold is not None
            and trim_threshold <= model.args.window
        ):
            raise ValueError(
                f"trim_threshold ({trim_threshold}) must exceed W ({model.args.window})"
            )
        self.model, self.mode = model, mode
        self.capture_sizes = list(capture_sizes)
        self.policy, self.halo_align = policy, halo_align
        self.trim_threshold = trim_threshold if mode == "piecewise" else None
        self.logit_slots = logit_slots
        self.device = model.embed.weight.device
        self.on_cuda = self.device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.on_cuda else None
        self.buffers = BreakBuffers()
        self.graphs: dict[int, SegmentedCapture] = {}
        self.static_steps: dict[int, StepBatch] = {}
        self.stats = CaptureStats()

    @property
    def attention_backend(self) -> str:
        return "static" if self.mode == "full" else "varlen"

    def uses_replay_batch(self, size: int) -> bool:
        return self.trim_threshold is not None and size >= self.trim_threshold

    def context(
        self, step: StepBatch, size: int, replay_batch: ReplayBatch | None,
        timer: object | None = None,
    ) -> ForwardContext:
        return ForwardContext(
            attn_metadata=step.metadata,
            logits_indices=step.logits_indices,
            batch_descriptor=BatchDescriptor(size),
            attention_backend=self.attention_backend,
            in_piecewise_graph=self.mode == "piecewise",
            replay_batch=replay_batch,
            timer=timer,
        )

    def replay_batch_for(self, step: StepBatch, size: int) -> ReplayBatch | None:
        if not self.uses_replay_batch(size):
            return None
        return build_replay_batch(
            step, self.policy, self.model.args, halo_align=self.halo_align, force=True
        )

    def capture_all(self) -> None:
        start = time.perf_counter()
        if self.on_cuda:
            gc.collect()
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device) if self.on_cuda else 0
        try:
            with torch.inference_mode(), replay_threshold(self.model, self.trim_threshold):
                for size in sorted(self.capture_sizes, reverse=True):
                    self._capture(size)
        except BaseException:
            self.graphs.clear()  # never keep a partial set: the next capture starts over
            self.static_steps.clear()
            raise
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            self.stats.pool_bytes = torch.cuda.memory_reserved(self.device) - before
        self.stats.seconds = time.perf_counter() - start
        self.stats.segments = sum(g.num_segments for g in self.graphs.values())
        self.stats.breaks = sum(g.num_breaks for g in self.graphs.values())

    def _capture(self, size: int) -> None:
        args = self.model.args
        static = build_step(
            [], [], [], args, self.device, pad_to=size, logit_slots=self.logit_slots, writes=False
        )
        ctx = self.context(static, size, self.replay_batch_for(static, size))
        capture = SegmentedCapture(
            functools.partial(CudaSegment, self.pool) if self.on_cuda else TapeSegment,
            self.buffers,
            breaks=self.mode == "piecewise",
        )
        with set_forward_context(ctx):
            self.model(static.input_ids)
            if self.on_cuda:
                torch.cuda.synchronize(self.device)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    capture.capture(lambda: self.model(static.input_ids))
                torch.cuda.current_stream(self.device).wait_stream(stream)
                torch.cuda.synchronize(self.device)
            else:
                capture.capture(lambda: self.model(static.input_ids))
        self.graphs[size] = capture
        self.static_steps[size] = static

    def replay(self, step: StepBatch, size: int, timer: object | None = None):
        """Runs ``step`` (padded to ``size``) through its graph: (logits, streams, replay batch)."""
        with torch.inference_mode():
            static_step = step.copy_into(self.static_steps[size])
            with region(timer, "prepare"):
                replay_batch = self.replay_batch_for(static_step, size)
            ctx = self.context(static_step, size, replay_batch, timer)
            with set_forward_context(ctx):
                logits, streams = self.graphs[size].replay()
        return logits, streams, replay_batch
