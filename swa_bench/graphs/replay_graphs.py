"""Replay graphs: a replay batch's layers in a graph of their own, one per replay capture size.

In PIECEWISE mode a step whose decoder runs on a replay batch breaks out of the model's graph to
the replay layers; run eagerly there they launch every kernel from Python, which made PIECEWISE
the slowest route for small and mid-size steps (issue 34). After vLLM's
``DecoderReplayCudaGraphManager``: the replay layers are captured as breakable PIECEWISE graphs
keyed by the replay batch's padded size (``capture_sizes.replay_capture_sizes``), sharing the
model graphs' memory pool; each replay copies the batch's per-row inputs by row into static buffers
(``index_select(..., out=)``: the mHC streams entering S, the pre-mix, S's publications) and its
metadata into static metadata, replays the graph on the padded rows, and hands back its static
outputs, which the replay batch cuts to the real rows.

What crosses into the graph and how:
* per-row inputs and the replay batch's metadata: static buffers, one set sized for the largest
  size (captured first), views for the others;
* S's batch KV of every batch row: only layer S's attention (an eager break) reads it, so the
  graph binds the step's tensor to that break's argument at each replay (``SegmentedCapture.run``
  bindings) instead of copying a tensor whose row count is the step's;
* layer S's metadata (its keys are every batch row) and S's publications in the context: read by
  the eager breaks from the live context (the model's ``receive_publications`` is a host effect,
  redone at each replay).

Capture runs on dummy batches of the dummy request, whose rows read nothing and write nothing, so
it never touches the caches; padded rows of a real replay write no KV for the same reason. The
graphs are bound to one cache, as the model graphs are.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import torch

from swa_bench.graphs.breakable import BreakBuffers, CudaSegment, SegmentedCapture
from swa_bench.graphs.capture import CaptureStats, held_bytes, record
from swa_bench.graphs.capture_sizes import check_capture_sizes
from swa_bench.graphs.standin import TapeSegment
from swa_bench.kernels.config import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, make_metadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import (
    ForwardContext,
    get_forward_context,
    region,
    set_forward_context,
)
from swa_bench.replay.replay_batch import ReplayBatch, replay_request_slots

ReplayLayers = Callable[..., tuple[torch.Tensor, ...]]


class ReplayGraphs:
    """The replay graphs of one engine: one segmented capture per size, on ``cache`` and
    ``kernels`` (the engine's), each captured at its first use from that call's input shapes."""

    def __init__(
        self, args: ModelArgs, sizes: Sequence[int], cache: KVCache, kernels: Kernels,
        device: torch.device, pool: object | None,
    ) -> None:
        check_capture_sizes(sizes)
        self.args, self.cache, self.kernels, self.device = args, cache, kernels, device
        self.sizes = list(sizes)
        self.pool = pool
        self.buffers = BreakBuffers()
        self.graphs: dict[int, SegmentedCapture] = {}
        self.static_inputs: list[torch.Tensor] = []
        self.static_metadata: dict[int, AttentionMetadata] = {}
        self.capture_kv: dict[int, torch.Tensor] = {}  # each size's stand-in for the batch KV
        self.stats = CaptureStats()

    def run(
        self, run_layers: ReplayLayers, batch_kv: torch.Tensor, inputs: Sequence[torch.Tensor],
        batch: ReplayBatch,
    ) -> tuple[torch.Tensor, ...]:
        """``ReplayBatch.run_graph``: the padded batch through its size's graph (static outputs,
        valid until the next replay of that size)."""
        size = batch.graph_size
        live = batch.forward_context
        if live.cache is not self.cache:
            raise RuntimeError("a replay graph runs only on the cache it is bound to")
        if size not in self.sizes:
            raise RuntimeError(f"no replay graph of {size} rows (sizes: {self.sizes})")
        if size not in self.graphs:
            self.capture(run_layers, batch_kv, inputs, [max(self.sizes), size])
        timer = get_forward_context().timer
        with torch.inference_mode():
            with region(timer, "gather"):
                for buf, t in zip(self.static_inputs, inputs, strict=True):
                    torch.index_select(t, 0, batch.padded_rows, out=buf[:size])
                # The batch's context runs on the static copy of its metadata (same values, the
                # step's host layouts): what the graph's segments read, and what the breaks and
                # the checks read of it after the replay.
                live.attn_metadata = live.attn_metadata.copy_into(self.static_metadata[size])
            with region(timer, "layers"), set_forward_context(live):
                return self.graphs[size].run({id(self.capture_kv[size]): batch_kv})

    def capture(
        self, run_layers: ReplayLayers, batch_kv: torch.Tensor, inputs: Sequence[torch.Tensor],
        sizes: Sequence[int] | None = None,
    ) -> None:
        """Captures ``sizes`` (default every size) not yet captured, largest first, on inputs
        shaped like ``inputs`` (rows aside). A size is captured at the first replay batch that
        pads to it (``run``), after the largest, which sizes the static and break buffers every
        smaller one takes views of: a replay capture size no step reaches costs no capture. A
        failed capture keeps none of this call's sizes."""
        todo = sorted({*(self.sizes if sizes is None else sizes)} - self.graphs.keys(),
                      reverse=True)
        if not todo:
            return
        if not self.graphs and todo[0] != max(self.sizes):
            raise RuntimeError("the largest replay capture size is captured first")
        start = time.perf_counter()
        before = held_bytes(self.device)
        if not self.static_inputs:
            largest = max(self.sizes)
            self.static_inputs = [t.new_zeros((largest, *t.shape[1:])) for t in inputs]
        try:
            with torch.inference_mode():
                for size in todo:
                    self._capture(size, run_layers, batch_kv)
        except BaseException:
            for size in todo:
                for held in (self.graphs, self.static_metadata, self.capture_kv):
                    held.pop(size, None)
            raise
        self.stats.pool_bytes += held_bytes(self.device) - before
        self.stats.seconds += time.perf_counter() - start
        self.stats.segments = sum(g.num_segments for g in self.graphs.values())
        self.stats.breaks = sum(g.num_breaks for g in self.graphs.values())

    def _capture(self, size: int, run_layers: ReplayLayers, batch_kv: torch.Tensor) -> None:
        args, slots = self.args, replay_request_slots(self.args)

        def dummy_metadata() -> AttentionMetadata:
            return make_metadata([], num_q_rows=size, num_kv_rows=size, args=args,
                                 device=self.device, num_request_slots=slots, writes=False)

        static = dummy_metadata()
        static.derived = None  # each replay overwrites its buffers: nothing derived is kept
        kv = batch_kv.new_zeros((size, *batch_kv.shape[1:]))
        ctx = ForwardContext(
            attn_metadata=static,
            logits_indices=torch.zeros(0, dtype=torch.long, device=self.device),
            cache=self.cache,
            kernels=self.kernels,
            layer_metadata={args.last_kv_source: dummy_metadata()},
        )
        segment = (functools.partial(CudaSegment, self.pool) if self.device.type == "cuda"
                   else TapeSegment)
        capture = SegmentedCapture(segment, self.buffers, breaks=True)
        views = [buf[:size] for buf in self.static_inputs]
        with set_forward_context(ctx):
            record(capture, lambda: run_layers(kv, *views), self.device)
        self.graphs[size] = capture
        self.static_metadata[size] = static
        self.capture_kv[size] = kv
