"""The replay layers: the rest of layer S and the decoder, on the replay batch when there is one.

Layer S's batch KV write runs before this on every row (and stays inside a captured segment); the
layers here take S's KV of every batch row plus per-row inputs (the mHC streams, S's attention
input and gains). On the replay batch the per-row inputs are gathered by kept rows, the layers run
under the replay batch's forward context, and the outputs are scattered back: zeros at trimmed
rows, which nothing reads.

Whether a step runs on a replay batch is the engine's decision, carried in the forward context
(``replay_batch``); these layers only read it. In a PIECEWISE capture the replay-batch route is an
eager break, so the gather, the kept-row layers and the scatter run eagerly at every graph replay.
"""

from __future__ import annotations

import torch

from swa_bench.model.forward_context import get_forward_context, region, set_forward_context
from swa_bench.model.graph_breaks import eager_break
from swa_bench.model.model import ReplayLayers, Streams, Transformer


class DecoderReplayLayers:
    """Wraps the model's whole-batch replay layers with the replay-batch route."""

    def __init__(self, run_layers: ReplayLayers) -> None:
        self.run_layers = run_layers

    def __call__(self, batch_kv: torch.Tensor, *inputs: torch.Tensor | None) -> Streams:
        if get_forward_context().replay_batch is None:
            return self.run_layers(batch_kv, *inputs)
        return self.run_on_replay_batch(batch_kv, *inputs)

    @eager_break("replay_layers")
    def run_on_replay_batch(self, batch_kv: torch.Tensor, *inputs: torch.Tensor | None) -> Streams:
        ctx = get_forward_context()
        replay_batch = ctx.replay_batch
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


def install(model: Transformer) -> None:
    """Gives ``model`` the replay-batch route (idempotent); without a replay batch in the
    forward context it still runs the whole batch, bit for bit as before."""
    if not isinstance(model.replay_layers, DecoderReplayLayers):
        model.replay_layers = DecoderReplayLayers(model.run_replay_layers)
