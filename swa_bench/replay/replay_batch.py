"""The replay batch of a step: its kept rows as a sub-batch with metadata and a context of its own.

Built on the host from the step's requests and the kept lengths the engine's step plan chose
(kept rows are a pure function of them), then moved to the device with one copy per tensor:
nothing here waits on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from swa_bench.kernels.config import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, RequestLayout, StepBatch, make_metadata
from swa_bench.model.forward_context import BatchDescriptor, ForwardContext
from swa_bench.replay.row_selection import kept_rows, kept_window_start


@dataclass
class ReplayBatch:
    """Kept rows (indices into the batch) and the context the replay layers run under."""

    rows: torch.Tensor
    kept_lens: tuple[int, ...]
    forward_context: ForwardContext

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]


def kept_layouts(step: StepBatch, lens: list[int]) -> list[RequestLayout]:
    """Each request's kept rows as a packed sub-batch whose key rows are its own rows."""
    out, start = [], 0
    for lay, req, k in zip(step.metadata.layouts, step.requests, lens, strict=True):
        first = lay.seq_len - k
        out.append(
            replace(
                lay,
                q_start=start,
                q_len=k,
                q_first_pos=first,
                kv_start=start,
                kv_len=k,
                kv_first_pos=first,
                window_start=kept_window_start(lay.window_start, lay.seq_len, k, req.query_len),
            )
        )
        start += k
    return out


def build_replay_batch(step: StepBatch, lens: Sequence[int], args: ModelArgs,
                       kernels: Kernels) -> ReplayBatch:
    """The replay batch of ``step`` keeping each request's last ``lens[i]`` rows, its layers run
    on ``kernels`` (the step's engine's)."""
    lens = list(lens)
    device = step.input_ids.device
    layouts = kept_layouts(step, lens)
    num_kept = sum(lens)
    metadata = make_metadata(
        layouts, num_q_rows=num_kept, num_kv_rows=num_kept, args=args, device=device
    )
    # The first replay layer's window attention reads the batch KV of every row with the batch's
    # window starts: its outputs at the kept rows are exact.
    first_layouts = [
        replace(batch_lay, q_start=kept.q_start, q_len=kept.q_len, q_first_pos=kept.q_first_pos)
        for batch_lay, kept in zip(step.metadata.layouts, layouts, strict=True)
    ]
    first_metadata = make_metadata(
        first_layouts, num_q_rows=num_kept, num_kv_rows=step.num_padded, args=args, device=device
    )
    rows = torch.tensor(kept_rows(step.requests, lens), dtype=torch.long).to(device)
    context = ForwardContext(
        attn_metadata=metadata,
        logits_indices=rows.new_zeros(0),
        batch_descriptor=BatchDescriptor(num_kept),
        kernels=kernels,
        layer_metadata={args.last_kv_source: first_metadata},
    )
    return ReplayBatch(rows=rows, kept_lens=tuple(lens), forward_context=context)


def bounded_reference_metadata(
    step: StepBatch, lens: Sequence[int], args: ModelArgs
) -> dict[int, AttentionMetadata]:
    """Decoder-layer metadata of the bounded reference: the whole batch, with each request's
    window masked below the kept start of its last ``lens[i]`` rows (layer S keeps the batch
    starts). A request keeping no row writes no decoder ring slot, as on the replay batch."""
    layouts = [
        replace(lay, window_start=kept_window_start(lay.window_start, lay.seq_len, k, r.query_len))
        for lay, r, k in zip(step.metadata.layouts, step.requests, lens, strict=True)
    ]
    metadata = make_metadata(
        layouts,
        num_q_rows=step.num_padded,
        num_kv_rows=step.num_padded,
        args=args,
        device=step.input_ids.device,
        num_request_slots=step.metadata.window_start.shape[0],
    )
    unwritten = [r for lay, k in zip(layouts, lens, strict=True) if k == 0
                 for r in range(lay.kv_start, lay.kv_start + lay.kv_len)]
    if unwritten:
        rows = torch.tensor(unwritten, dtype=torch.long, device=metadata.ring_slot.device)
        metadata.ring_slot.index_fill_(0, rows, args.max_requests * args.window)
    return {layer: metadata for layer in range(args.last_kv_source + 1, args.n_layers)}
