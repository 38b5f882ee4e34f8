"""A step as a serving engine packs it, and the attention metadata of a batch of rows.

Rows are packed request after request. Attention metadata separates the query rows (the rows a
forward runs on) from the key rows (the rows whose window KV this forward computed): they are the
same rows except for the first replay layer on the replay batch, whose keys are every batch row.

Caches are flat tensors with a trash row at the end: a row that must not write (a padded row, a row
below a request's last W) writes its slot ``-1``, mapped to the trash row, so writes keep a static
shape inside captured graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from swa_bench.model.args import ModelArgs
from swa_bench.model.requests import RequestSpec, query_starts

NO_WINDOW = 1 << 40  # window start of the dummy request that padded rows belong to: reads nothing


def batch_window_start(context_len: int, window: int) -> int:
    """``replay_start``: 0 for a cold prefill, H - W after context ending at H.

    Only the last W cached positions still have window KV (the ring), so nothing below may be read.
    """
    return max(0, context_len - window)


def request_window_start(request: RequestSpec, window: int) -> int:
    """A request's batch window start: ``batch_window_start`` of its context, or its
    ``cached_len`` when its first rows recompute a prefix hit's window (vLLM's ``replay_start``:
    no window KV of the hit was cached, so no window layer reads below the recomputed rows)."""
    if request.recomputed_rows:
        return request.cached_len
    return batch_window_start(request.context_len, window)


@dataclass(frozen=True)
class RequestLayout:
    """Where one request's query and key rows sit, in host integers (eager kernels loop on it)."""

    cache_index: int
    q_start: int
    q_len: int
    q_first_pos: int
    kv_start: int
    kv_len: int
    kv_first_pos: int
    window_start: int
    seq_len: int
    # Key rows below this position write no global KV (a prefix hit's recomputed rows: the
    # caches hold it already); 0: every key row writes.
    global_from: int = 0


@dataclass
class AttentionMetadata:
    """Device tensors of one attention call; per-request arrays end with a dummy request."""

    positions: torch.Tensor  # [q rows] position of each query row
    row_request: torch.Tensor  # [q rows] request index; padded rows -> the dummy
    window_start: torch.Tensor  # [requests + 1] lowest position whose window KV may be read
    kv_first_pos: torch.Tensor  # [requests + 1] position of the request's first key row
    kv_row_start: torch.Tensor  # [requests + 1] index of that key row
    seq_len: torch.Tensor  # [requests + 1]
    cache_index: torch.Tensor  # [requests + 1]
    ring_slot: torch.Tensor  # [kv rows] flat ring slot each key row writes (trash: none)
    global_slot: torch.Tensor  # [kv rows] flat global slot of each key row (trash: none)
    layouts: tuple[RequestLayout, ...]
    # The one device buffer every tensor above is a view of (None when built otherwise): a step
    # moves to the device in one copy, and into a graph's static metadata in one copy.
    packed: torch.Tensor | None = None
    # Tensors derived from the ones above, computed by the first layer that needs them and read
    # by the rest (``derived_tensor``); a new instance (``replace``) starts empty. None: never
    # kept, for a graph's static metadata, whose buffers each step overwrites in place.
    derived: dict | None = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("layouts", "packed", "derived")
        }

    def derived_tensor(self, key: tuple, compute) -> torch.Tensor:
        """``compute()``, once per metadata: every layer of a step reads the same window index.
        Recomputed every time for static metadata (``derived`` None), so that a graph's warm-up
        and its capture each compute it."""
        if self.derived is None:
            return compute()
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]

    def copy_into(self, static: AttentionMetadata) -> AttentionMetadata:
        """Copies every tensor into ``static``'s buffers (same shapes) and returns ``static`` with
        this step's host layouts: graph segments read the buffers, eager breaks the layouts."""
        same_layout = (
            self.packed is not None
            and static.packed is not None
            and self.packed.shape == static.packed.shape
        )
        if same_layout:
            static.packed.copy_(self.packed, non_blocking=True)
        else:
            for name, src in self.tensors().items():
                getattr(static, name).copy_(src, non_blocking=True)
        return replace(static, layouts=self.layouts)


def rows_of(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For requests of ``lengths`` rows, packed in order: each row's request and its offset in
    that request (vectorised: no loop over requests)."""
    request = np.repeat(np.arange(lengths.shape[0]), lengths)
    starts = np.cumsum(lengths) - lengths
    return request, np.arange(request.shape[0]) - starts[request]


LAYOUT_FIELDS = tuple(f.name for f in fields(RequestLayout))


def make_metadata(
    layouts: Sequence[RequestLayout],
    *,
    num_q_rows: int,
    num_kv_rows: int,
    args: ModelArgs,
    device: torch.device,
    num_request_slots: int | None = None,
    writes: bool = True,
) -> AttentionMetadata:
    """Builds the tensors on the host with vectorised numpy ops (a step's host cost: a torch op
    on small host tensors costs several times a numpy one) and moves them in one copy.

    ``num_request_slots`` fixes the per-request arrays' length (graphs need it static); the dummy
    request takes the last slot. ``writes=False`` sends every write to the trash row (capture and
    warm-up run on dummy batches and must not touch the caches).
    """
    slots = num_request_slots if num_request_slots is not None else len(layouts) + 1
    if slots < len(layouts) + 1:
        raise ValueError(f"{len(layouts)} requests need {len(layouts) + 1} request slots")
    dummy = slots - 1
    window, max_seq = args.window, args.max_seq_len
    ring_trash, global_trash = args.max_requests * window, args.max_requests * max_seq
    n = len(layouts)
    table = np.array(
        [[getattr(lay, f) for f in LAYOUT_FIELDS] for lay in layouts], dtype=np.int64
    ).reshape(n, len(LAYOUT_FIELDS))
    lay = dict(zip(LAYOUT_FIELDS, table.T, strict=True))
    sizes = (num_q_rows, num_q_rows, slots, slots, slots, slots, slots, num_kv_rows, num_kv_rows)
    packed = np.zeros(sum(sizes), dtype=np.int64)
    positions, row_request, *per_request, ring_slot, global_slot = np.split(
        packed, np.cumsum(sizes)[:-1])

    row_request[:] = dummy
    request, offset = rows_of(lay["q_len"])
    rows = lay["q_start"][request] + offset
    positions[rows] = lay["q_first_pos"][request] + offset
    row_request[rows] = request

    ring_slot[:] = ring_trash
    global_slot[:] = global_trash
    if writes:
        request, offset = rows_of(lay["kv_len"])
        rows = lay["kv_start"][request] + offset
        kv_pos = lay["kv_first_pos"][request] + offset
        cache_index = lay["cache_index"][request]
        global_slot[rows] = np.where(kv_pos >= lay["global_from"][request],
                                     cache_index * max_seq + kv_pos, global_trash)
        in_ring = kv_pos >= lay["seq_len"][request] - window
        ring_slot[rows] = np.where(in_ring, cache_index * window + kv_pos % window, ring_trash)

    names = ("window_start", "kv_first_pos", "kv_row_start", "seq_len", "cache_index")
    per_request[0][dummy] = NO_WINDOW
    for arr, column in zip(per_request,
                                 ("window_start", "kv_first_pos", "kv_start", "seq_len",
                                  "cache_index"), strict=True):
        arr[:n] = lay[column]
    on_device = torch.from_numpy(packed).to(device, non_blocking=True)
    views = on_device.split(list(sizes))
    parts = ("positions", "row_request", *names, "ring_slot", "global_slot")
    return AttentionMetadata(
        **dict(zip(parts, views, strict=True)), layouts=tuple(layouts), packed=on_device
    )


@dataclass
class StepBatch:
    """One packed step: token ids, the batch's attention metadata, the rows whose logits return."""

    requests: tuple[RequestSpec, ...]
    cache_indices: tuple[int, ...]
    input_ids: torch.Tensor  # [padded rows]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [logit slots]
    num_logits: int
    num_tokens: int

    @property
    def num_padded(self) -> int:
        return self.input_ids.shape[0]

    def logit_rows(self) -> list[tuple[int, int]]:
        """(request index, position) of each returned logits row, in order."""
        rows = []
        for i, lay in enumerate(self.metadata.layouts):
            first = 0 if self.requests[i].every_row_logits else lay.q_len - 1
            rows.extend((i, lay.q_first_pos + j) for j in range(first, lay.q_len))
        return rows

    def copy_into(self, static: StepBatch) -> StepBatch:
        """This step in ``static``'s buffers (equal padded shapes)."""
        static.input_ids.copy_(self.input_ids, non_blocking=True)
        static.logits_indices.copy_(self.logits_indices, non_blocking=True)
        return replace(
            self,
            input_ids=static.input_ids,
            logits_indices=static.logits_indices,
            metadata=self.metadata.copy_into(static.metadata),
        )


def build_step(
    requests: Sequence[RequestSpec],
    token_ids: Sequence[Sequence[int]],
    cache_indices: Sequence[int],
    args: ModelArgs,
    device: torch.device,
    *,
    pad_to: int | None = None,
    logit_slots: int | None = None,
    writes: bool = True,
) -> StepBatch:
    """Packs ``requests`` (their tokens for this step) into a batch of ``pad_to`` rows.

    Padded rows take token 0 at position 0 and write nothing; ``logit_slots`` pads the logits
    indices (to row 0) so a captured graph computes a fixed number of logits rows.
    """
    if len({*cache_indices}) != len(cache_indices):
        raise ValueError("two requests of one step share a cache index")
    starts = query_starts(requests)
    num_tokens = starts[-1]
    padded = num_tokens if pad_to is None else pad_to
    if padded < num_tokens:
        raise ValueError(f"cannot pad {num_tokens} tokens to {padded}")
    layouts = []
    ids = [0] * padded
    logits_indices: list[int] = []
    for i, (req, toks, ci) in enumerate(zip(requests, token_ids, cache_indices, strict=True)):
        if len(toks) != req.query_len:
            raise ValueError(f"request {i}: {len(toks)} tokens for {req.query_len} rows")
        if req.seq_len > args.max_seq_len or not 0 <= ci < args.max_requests:
            raise ValueError(f"request {i} does not fit the caches (seq_len {req.seq_len})")
        ids[starts[i] : starts[i + 1]] = toks
        layouts.append(
            RequestLayout(
                cache_index=ci,
                q_start=starts[i],
                q_len=req.query_len,
                q_first_pos=req.context_len,
                kv_start=starts[i],
                kv_len=req.query_len,
                kv_first_pos=req.context_len,
                window_start=request_window_start(req, args.window),
                seq_len=req.seq_len,
                global_from=req.filled_len,
            )
        )
        first = starts[i] if req.every_row_logits else starts[i + 1] - 1
        logits_indices.extend(range(first, starts[i + 1]))
    num_logits = len(logits_indices)
    if logit_slots is not None:
        if logit_slots < num_logits:
            raise ValueError(f"{num_logits} logits rows exceed {logit_slots} slots")
        logits_indices += [0] * (logit_slots - num_logits)
    slots = None if pad_to is None else args.max_requests + 1
    metadata = make_metadata(
        layouts,
        num_q_rows=padded,
        num_kv_rows=padded,
        args=args,
        device=device,
        num_request_slots=slots,
        writes=writes,
    )
    return StepBatch(
        requests=tuple(requests),
        cache_indices=tuple(cache_indices),
        input_ids=torch.tensor(ids, dtype=torch.long).to(device),
        metadata=metadata,
        logits_indices=torch.tensor(logits_indices, dtype=torch.long).to(device),
        num_logits=num_logits,
        num_tokens=num_tokens,
    )
