"""Which rows each request keeps, and the lowest window position each may read (SPEC section 2).

Pure functions over host integers: the step is planned before anything runs on the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from swa_bench.model.batch import request_window_start
from swa_bench.model.requests import RequestSpec, query_starts

Policy = Literal["full", "bounded", "halo", "final_window", "tail"]
POLICIES: tuple[Policy, ...] = ("full", "bounded", "halo", "final_window", "tail")

# ROCm ATOM's tail (``atom/models/deepseek_v41/bounded_replay.py``) keeps each request's last
# ``tail_len = sliding_window + num_speculative_tokens`` rows of the step (the window ring, "133 on
# V4.1-Flash with five DSpark tokens"), so the prefill rewrites every ring slot the draft reads;
# this is V4.1-Flash's DSpark count (ATOM keeps W + 0 without speculative decoding). ATOM
# replays only "an eager text prefill with a request longer than the tail" whose rows are
# unpadded: ``dispatch.plan_step`` keeps graph steps on the whole batch under ``tail``.
TAIL_SPECULATIVE_TOKENS = 5


def halo_size(window: int, n_decoder_layers: int, align: int = 1) -> int:
    """H = W + (D - 1)(W - 1), rounded up to ``align``.

    Each window layer after the first widens the backward dependency cone by W - 1 rows, so the last
    token and every decoder ring's last W slots depend only on the last H rows.
    """
    if window < 1 or align < 1:
        raise ValueError("window and align must be >= 1")
    size = window + max(n_decoder_layers - 1, 0) * (window - 1)
    return math.ceil(size / align) * align


def kept_len(request: RequestSpec, policy: Policy, window: int, halo: int) -> int:
    """How many of the request's last rows in this step stay in the replay batch.

    * ``full``: every row;
    * ``bounded`` (vLLM #56752/#58132): the last min(q, W); every prefill chunk keeps its own;
    * ``halo``: the last min(q, H);
    * ``final_window`` (TensorRT-LLM ``decoder_replay.plan_decoder_replay``): a chunk keeps its
      intersection with the final prompt window ``[end - W, end)``, ``end`` = prompt length, so a
      chunk wholly before it keeps none and, when the last chunk is shorter than W, the chunk
      before it keeps its rows inside the window (see ``final_window_floor``);
    * ``tail`` (ROCm ATOM ``late_layer_tail_layout``): the last min(q, W + TAIL_SPECULATIVE_TOKENS),
      every chunk its own; a request kept whole reads from its batch start.

    Under every policy a request keeps all its rows where the engines do (``keeps_every_row``).
    """
    q = request.query_len
    if policy == "full" or keeps_every_row(request):
        return q
    if policy == "bounded":
        return min(q, window)
    if policy == "halo":
        return min(q, halo)
    if policy == "final_window":
        return max(0, request.seq_len - max(request.cached_len, request.prompt_len - window))
    if policy == "tail":
        return min(q, window + TAIL_SPECULATIVE_TOKENS)
    raise ValueError(f"unknown policy {policy!r}")


def keeps_every_row(request: RequestSpec) -> bool:
    """The per-request gates: a request whose every row is read keeps them all, under every
    policy (an engine that trimmed them would return zeros where logits are asked for).

    * decode and speculative verify rows (vLLM ``DeepseekV41ModelState._kept_input_batch``:
      "decodes never trim"; TensorRT-LLM ``plan_decoder_replay``: "Generation and speculative
      verification rows keep their live endpoints and every query");
    * prompt logprobs (vLLM ``DeepseekV41ModelState.add_request``: "Requests whose every prompt
      row is read (prompt logprobs) never trim");
    * context logits (TensorRT-LLM ``pyexecutor/ced_replay.requires_full_decoder_prefill``:
      ``py_return_context_logits``, "Requests whose consumers need every context row";
      ``plan_decoder_replay`` skips them: no trim, no floor).
    """
    return request.decode or request.prompt_logprobs or request.context_logits


def kept_lens(requests: Sequence[RequestSpec], policy: Policy, window: int, halo: int) -> list[int]:
    return [kept_len(r, policy, window, halo) for r in requests]


def trims(requests: Sequence[RequestSpec], lens: Sequence[int]) -> bool:
    """Whether some request loses rows: only then does a step need a replay batch."""
    return any(k < r.query_len for r, k in zip(requests, lens, strict=True))


def kept_rows(requests: Sequence[RequestSpec], lens: Sequence[int]) -> list[int]:
    """Batch row indices of the kept rows: each request's last ``kept_len`` rows, in batch order."""
    rows: list[int] = []
    starts = query_starts(requests)
    for i, k in enumerate(lens):
        end = starts[i + 1]
        rows.extend(range(end - k, end))
    return rows


def kept_window_start(replay_start: int, seq_len: int, kept: int, query_len: int) -> int:
    """``kept_kv_start``: decoder layers under replay never computed window KV below this.

    ``replay_start`` is the lowest position whose decoder window KV is valid: the batch start,
    raised to the request's ``decoder_floor`` where it has one. A request that keeps all its rows
    reads from there (a decode row reads its ring); one that keeps none gets ``seq_len``:
    nothing of this step is visible.
    """
    if kept >= query_len:
        return replay_start
    return max(replay_start, seq_len - kept)


def final_window_floor(request: RequestSpec, window: int) -> int:
    """TensorRT-LLM's one floor ``end - W``: every chunk inside the final prompt window reads
    decoder window KV from there, even one that keeps all its rows (earlier KV inside it is valid).
    """
    return max(0, request.prompt_len - window)


def decoder_floor(request: RequestSpec, policy: Policy, window: int) -> int:
    """The lowest position the request's decoder layers may read on the replay batch (0: none
    beyond the batch start).

    Only ``final_window`` has one (TensorRT-LLM ``decoder_replay.plan_decoder_replay``:
    ``floors[i] = max(start, recovery_floor)`` with ``start = max(0, end - W)`` for each context
    chunk, "the same floor spans all chunks in this final window. Earlier decoder KV inside it
    is valid, even when this chunk keeps all rows"). The chunks before the window kept no decoder
    row, so below the floor a decoder ring holds nothing this prompt wrote: a chunk inside the
    window that keeps every row (the 60 after 240 of a 300-token prompt, W = 128) must still read
    from ``end - W``, not from its batch start ``cached - W``. A chunk wholly before the window
    keeps no row (nothing reads, floor 0); generation rows and requests needing every decoder row
    (prompt logprobs; TensorRT-LLM's ``requires_full_decoder_prefill``) have none.
    """
    if policy != "final_window" or keeps_every_row(request):
        return 0
    floor = final_window_floor(request, window)
    return floor if request.seq_len > floor else 0


def decoder_floors(requests: Sequence[RequestSpec], policy: Policy, window: int) -> list[int]:
    return [decoder_floor(r, policy, window) for r in requests]


def floor_raises_window(requests: Sequence[RequestSpec], floors: Sequence[int],
                        window: int) -> bool:
    """Whether some request's floor lies above its batch start (``context_len - W``): then its
    decoder layers must read from the floor even if it keeps every row, which only the replay
    batch applies (the whole batch reads every layer from the batch start)."""
    return any(f > request_window_start(r, window)
               for r, f in zip(requests, floors, strict=True))


def gate_notes(requests: Sequence[RequestSpec]) -> list[str]:
    """The per-request gates of a step in the route's words (``dispatch.plan_step`` appends
    them): requests kept whole by what they ask for, and prefix hits served by recomputing
    their window (``requests.prefix_hit_request``)."""
    counts = {
        "prompt logprobs": sum(r.prompt_logprobs for r in requests if not r.decode),
        "context logits": sum(r.context_logits for r in requests if not r.decode),
        "spec verify": sum(r.spec_decode_tokens > 0 for r in requests),
    }
    notes = [f"{n} {what} kept whole" for what, n in counts.items() if n]
    hits = [r for r in requests if r.recomputed_rows]
    if hits:
        notes.append("prefix hit recomputes " + ", ".join(
            f"[{r.cached_len}, {r.filled_len})" for r in hits))
    return notes
