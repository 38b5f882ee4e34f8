"""The replay batch of a step: its kept rows as a sub-batch with metadata and a context of its own,
and the route that runs the replay layers on them.

Built on the host from the step's requests and the kept lengths the engine's step plan chose
(kept rows are a pure function of them), then moved to the device with one copy per tensor:
nothing here waits on the device.

The replay layers (the rest of layer S and the decoder) take S's KV of every batch row plus per-row
inputs (``model.ReplayInputs`` flattened: the mHC streams entering S, the pre-mix S's attention
collapses them with, a ``[T, hc]`` fp32 tensor, and S's publications: its indexer's top-k
selection and candidate blocks, computed on every row as vLLM's ``row_buffers`` and TensorRT-LLM's
``csa2_candidates`` hold them; S computes its attention input again on the kept rows) and give
back the final streams and final pre-mix. ``ReplayBatch.run`` gathers every per-row input by kept
rows, whatever its shape and dtype, runs the layers under the replay batch's context (where the
kept rows' publications are read), and scatters every output back: zeros at trimmed rows, which
nothing reads. Layer S's batch KV write runs before this on every row (and stays inside a captured
segment), its attention input collapsed there with the same pre-mix. The engine puts the batch in
the step's forward context; the model's ``replay_layers`` calls ``run`` (in a PIECEWISE capture an
eager break, so the gather, the kept-row layers and the scatter run eagerly at every graph
replay).

A replay batch may run in a graph of its own (a replay graph, issue 34; vLLM's
``ReplayBatch.run_graph``): the plan pads its rows to a replay capture size, every padded row a copy
of batch row 0's inputs under the dummy request (it reads nothing and writes no KV), and the
engine sets ``run_graph``, which copies the inputs into the graph's static buffers and replays it.
Without ``run_graph`` a padded batch runs the same padded rows eagerly: what E3 compares a replay
graph with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from swa_bench.kernels.config import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import RequestLayout, StepBatch, make_metadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import (
    ForwardContext,
    get_forward_context,
    region,
    set_forward_context,
)
from swa_bench.replay.row_selection import kept_rows, kept_window_start


class RunGraph(Protocol):
    """Runs a padded replay batch's layers in its replay graph (``graphs.ReplayGraphs.run``):
    the inputs gathered by ``batch.padded_rows`` into static buffers, the graph replayed under
    ``batch.forward_context``; returns its static outputs, one row per padded row."""

    def __call__(
        self, run_layers: Callable[..., tuple[torch.Tensor, ...]], batch_kv: torch.Tensor,
        inputs: Sequence[torch.Tensor], batch: ReplayBatch,
    ) -> tuple[torch.Tensor, ...]: ...


@dataclass
class ReplayBatch:
    """Kept rows (indices into the batch) and the context the replay layers run under.

    ``padded_rows`` (None: unpadded) are ``rows`` followed by batch row 0 up to the replay graph's
    size, which the context's metadata is padded to; ``run_graph`` is set when the batch runs in
    that graph."""

    rows: torch.Tensor
    kept_lens: tuple[int, ...]
    forward_context: ForwardContext
    padded_rows: torch.Tensor | None = None
    run_graph: RunGraph | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    @property
    def graph_size(self) -> int | None:
        return None if self.padded_rows is None else self.padded_rows.shape[0]

    def run(
        self,
        run_layers: Callable[..., tuple[torch.Tensor, ...]],
        batch_kv: torch.Tensor,
        *inputs: torch.Tensor,
        out: Sequence[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """``run_layers`` on the kept rows (``ReplayRoute``): gather, run, scatter, each timed
        under the step's timer. Row ``j`` of every gathered input is batch row ``rows[j]``.
        The outputs are scattered into ``out`` (a graph break's buffers, one per output, batch
        rows) where given, else into fresh tensors."""
        timer = get_forward_context().timer
        if self.run_graph is not None:
            outputs = self.run_graph(run_layers, batch_kv, inputs, self)
        else:
            rows = self.rows if self.padded_rows is None else self.padded_rows
            with region(timer, "gather"):
                gathered = [t.index_select(0, rows) for t in inputs]
            with region(timer, "layers"), set_forward_context(self.forward_context):
                outputs = run_layers(batch_kv, *gathered)
        n, rows = self.num_rows, batch_kv.shape[0]
        with region(timer, "scatter"):
            if out is None:
                out = [o.new_zeros((rows, *o.shape[1:])) for o in outputs]
            else:
                for buf in out:
                    buf.zero_()
            return tuple(buf.index_copy_(0, self.rows, o[:n])
                         for buf, o in zip(out, outputs, strict=True))


def kept_layouts(step: StepBatch, lens: list[int],
                 floors: Sequence[int] | None = None) -> list[RequestLayout]:
    """Each request's kept rows as a packed sub-batch whose key rows are its own rows, its decoder
    windows starting at ``kept_window_start`` from its batch start raised to its floor
    (``row_selection.decoder_floor``, chosen in the step plan; None: no floors)."""
    floors = [0] * len(lens) if floors is None else list(floors)
    out, start = [], 0
    for lay, req, k, floor in zip(step.metadata.layouts, step.requests, lens, floors,
                                  strict=True):
        first = lay.seq_len - k
        valid_from = max(lay.window_start, floor)
        out.append(
            replace(
                lay,
                q_start=start,
                q_len=k,
                q_first_pos=first,
                kv_start=start,
                kv_len=k,
                kv_first_pos=first,
                window_start=kept_window_start(valid_from, lay.seq_len, k, req.query_len),
            )
        )
        start += k
    return out


def replay_request_slots(args: ModelArgs) -> int:
    """Per-request metadata length of a padded replay batch: fixed, as a replay graph's static
    metadata needs (every request slot and the dummy one)."""
    return args.max_requests + 1


def build_replay_batch(step: StepBatch, lens: Sequence[int], args: ModelArgs, cache: KVCache,
                       kernels: Kernels, *, pad_to: int | None = None,
                       floors: Sequence[int] | None = None) -> ReplayBatch:
    """The replay batch of ``step`` keeping each request's last ``lens[i]`` rows, its decoder
    windows raised to ``floors`` (the plan's ``decoder_floors``); its layers run on ``cache``
    and ``kernels``, the step's engine's. ``pad_to`` (a replay capture size) pads its rows and
    metadata to that many rows, the padded rows belonging to the dummy request."""
    lens = list(lens)
    device = step.input_ids.device
    layouts = kept_layouts(step, lens, floors)
    num_kept = sum(lens)
    if pad_to is not None and pad_to < num_kept:
        raise ValueError(f"a replay batch of {num_kept} rows does not pad to {pad_to}")
    num_rows = num_kept if pad_to is None else pad_to
    slots = None if pad_to is None else replay_request_slots(args)
    metadata = make_metadata(
        layouts, num_q_rows=num_rows, num_kv_rows=num_rows, args=args, device=device,
        num_request_slots=slots,
    )
    # The first replay layer's window attention reads the batch KV of every row with the batch's
    # window starts: its outputs at the kept rows are exact.
    first_layouts = [
        replace(batch_lay, q_start=kept.q_start, q_len=kept.q_len, q_first_pos=kept.q_first_pos)
        for batch_lay, kept in zip(step.metadata.layouts, layouts, strict=True)
    ]
    first_metadata = make_metadata(
        first_layouts, num_q_rows=num_rows, num_kv_rows=step.num_padded, args=args,
        device=device, num_request_slots=slots,
    )
    kept = kept_rows(step.requests, lens)
    padded = None
    if pad_to is None:
        rows = torch.tensor(kept, dtype=torch.long).to(device)
    else:  # one copy: the kept rows are the padded rows' head
        padded = torch.tensor(kept + [0] * (pad_to - num_kept), dtype=torch.long).to(device)
        rows = padded[:num_kept]
    context = ForwardContext(
        attn_metadata=metadata,
        logits_indices=rows.new_zeros(0),
        cache=cache,
        kernels=kernels,
        layer_metadata={args.last_kv_source: first_metadata},
    )
    return ReplayBatch(rows=rows, kept_lens=tuple(lens), forward_context=context,
                       padded_rows=padded)

