"""The replay layers: the rest of layer S and the decoder, on the replay batch when there is one.

Layer S's batch KV write runs before this on every row (and stays inside a captured segment); the
layers here take S's KV of every batch row plus per-row inputs (the mHC streams, S's attention
input and gains). On the replay batch the per-row inputs are gathered by kept rows, the layers run
under the replay batch's forward context, and the outputs are scattered back: zeros at trimmed
rows, which nothing reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swa_bench.bench.timing import region
from swa_bench.forward_context import get_forward_context, in_piecewise_graph, set_forward_context
from swa_bench.graphs.breakable import eager_break

RunLayers = Callable[..., tuple[torch.Tensor, ...]]


class DecoderReplayLayers:
    def __init__(self, window: int, run_layers: RunLayers) -> None:
        self.window = window
        self.run_layers = run_layers
        # Set with PIECEWISE replay graphs: graphs of this many tokens or more break out to the
        # replay batch. Must exceed the window: smaller steps cannot trim enough to pay.
        self.trim_threshold: int | None = None
        self._run_in_graph_break = eager_break("replay_layers")(self._run)

    def __call__(
        self, batch_kv: torch.Tensor, *inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        if self.uses_replay_batch():
            if in_piecewise_graph():
                return self._run_in_graph_break(batch_kv, *inputs)
            return self._run(batch_kv, *inputs)
        return self.run_layers(batch_kv, *inputs)

    def uses_replay_batch(self) -> bool:
        """In a PIECEWISE graph: by its padded size, fixed at capture. Otherwise: whether the step
        set a replay batch."""
        ctx = get_forward_context()
        if ctx.in_piecewise_graph:
            return self.graph_uses_replay_batch(ctx.batch_descriptor.num_tokens)
        return ctx.replay_batch is not None

    def graph_uses_replay_batch(self, num_tokens: int) -> bool:
        """Shared by capture and by the runtime that builds the replay batch for a graph."""
        return self.trim_threshold is not None and num_tokens >= self.trim_threshold

    def _run(
        self, batch_kv: torch.Tensor, *inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        ctx = get_forward_context()
        replay_batch = ctx.replay_batch
        if replay_batch is None:
            raise RuntimeError("the replay layers broke out to a replay batch but none is set")
        num_tokens = batch_kv.shape[0]
        rows = replay_batch.rows
        with region(ctx.timer, "gather"):
            gathered = [None if t is None else t.index_select(0, rows) for t in inputs]
        with region(ctx.timer, "layers"), set_forward_context(replay_batch.forward_context):
            outputs = self.run_layers(batch_kv, *gathered)
        with region(ctx.timer, "scatter"):
            return tuple(
                out.new_zeros((num_tokens, *out.shape[1:])).index_copy_(0, rows, out)
                for out in outputs
            )
