"""An independent oracle of bounded replay: the SPEC's rules written a second time, naively.

The checks must not grade the replay code with the replay code: if E1's reference took its kept
rows and window starts from ``swa_bench.replay``, a wrong rule would move both sides together and
every check would pass. So this module restates SPEC sections 2 and 4 from the text alone (it
imports neither ``swa_bench.replay`` nor ``swa_bench.engine.dispatch``; a test enforces that):

* ``kept_len``/``expect_step``: which rows each request keeps under every policy, where its
  windows start, whether the step trims, which route it takes (graph size, replay batch or not,
  attention's shape mode) given the graph mode and thresholds;
* ``oracle_forward``: the same step run through the model with metadata, gather and scatter built
  here (its own replay route, ``KeptRows``, in a context of its own: the model is not touched),
  at the padded shape and shape mode the oracle expects. When the engine is right it runs the
  same kernels on the same shapes as the engine, so the two agree **bitwise**; a selection,
  gather, scatter or routing bug shows as a mismatch whatever the dtype. Its route names what it
  carries (``KeptRows``: the streams and the delayed mHC pre-mix, in and out);
* ``bounded_reference_metadata``: the full-batch bounded reference of SPEC E1 (decoder windows
  masked below the oracle's kept starts, decoder ring writes only from kept rows), whose distance
  to ``oracle_forward`` is the rounding envelope of two batch compositions of one function;
* DSpark's draft layers read aux hidden states of decoder layers, so they exist on kept rows
  only: the oracle's route scatters them back like the streams (zeros at trimmed rows), the draft
  rings are written from kept rows, and the bounded reference masks the draft layers' ring writes
  to kept rows as it masks the decoder's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from swa_bench.kernels.config import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, RequestLayout, StepBatch, make_metadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ForwardContext, set_forward_context
from swa_bench.model.model import ReplayInputs, ReplayOutputs
from swa_bench.model.requests import RequestSpec

if TYPE_CHECKING:
    from swa_bench.engine.engine import Engine

ORACLE_POLICIES = ("full", "bounded", "halo", "final_window", "tail")
# ROCm ATOM keeps W + num_speculative_tokens rows (its ring): 5 DSpark tokens on V4.1-Flash
TAIL_EXTRA = 5


def halo_rows(window: int, decoder_layers: int, align: int = 1) -> int:
    """H = W + (D - 1)(W - 1) rounded up to ``align``: D window layers, each but the first
    widening the backward dependency cone of the last W positions by W - 1 rows."""
    exact = window + (decoder_layers - 1) * (window - 1) if decoder_layers > 0 else window
    return -(-exact // align) * align


def kept_len(
    r: RequestSpec, policy: str, window: int, decoder_layers: int, halo_align: int = 1
) -> int:
    """Rows of this step the request keeps (SPEC section 2 and the issue's policy list). The
    per-request gates (issue 30), whatever the policy: a decode row and its speculative verify
    rows, a prompt-logprobs request (vLLM) and a context-logits one (TensorRT-LLM) return logits
    at every row, so none of their rows is trimmed."""
    q = r.query_len
    reads_every_row = r.decode or r.prompt_logprobs or r.context_logits
    if policy == "full" or reads_every_row:
        return q
    if policy == "bounded":
        return min(q, window)
    if policy == "halo":
        return min(q, halo_rows(window, decoder_layers, halo_align))
    if policy == "final_window":
        # TensorRT-LLM: the chunk's overlap with the final prompt window [end - W, end)
        first_in_window = max(r.prompt_len - window, r.cached_len)
        return len(range(first_in_window, r.cached_len + q))
    if policy == "tail":
        return min(q, window + TAIL_EXTRA)
    raise ValueError(f"the oracle knows no policy {policy!r}")


def final_window_floor(r: RequestSpec, window: int) -> int:
    """TensorRT-LLM: chunks in the final prompt window read decoder KV from ``end - W``."""
    return max(0, r.prompt_len - window)


def decoder_floor(r: RequestSpec, policy: str, window: int) -> int:
    """Where a request's decoder layers start reading on the replay batch, whatever it keeps
    (0: no floor). TensorRT-LLM (``plan_decoder_replay``) gives every context chunk of a request
    that does not need full decoder prefill the floor ``max(0, end - W)``, "even when this chunk
    keeps all rows", since the earlier chunks wrote no decoder KV below it; generation rows get
    none. Restated here over the chunk's positions: it has one when some of them lie in the
    final window."""
    if policy != "final_window" or r.decode or r.prompt_logprobs or r.context_logits:
        return 0  # TensorRT-LLM skips a request needing full decoder prefill: no floor
    start = final_window_floor(r, window)
    in_window = [p for p in range(r.cached_len, r.cached_len + r.query_len) if p >= start]
    return start if in_window else 0


def halo_exact_rows(layer: int, kept_lens: Sequence[int], args: ModelArgs) -> list[int]:
    """The kept rows (indices into the replay batch) whose input to ``layer`` a halo replay
    computes as the full prefill does: every kept row at S; at the d-th decoder layer all but
    each request's first (d - 1)(W - 1) kept rows, since each decoder layer before it reads a
    window cut at the kept start (SPEC section 2, halo)."""
    lost = max(0, layer - args.last_kv_source - 1) * (args.window - 1)
    out, start = [], 0
    for k in kept_lens:
        out += range(start + min(lost, k), start + k)
        start += k
    return out


def batch_start(r: RequestSpec, window: int) -> int:
    """``replay_start``: 0 cold; context_len - W after a prefix hit or earlier chunks; where the
    step's first rows recompute a prefix hit's window (vLLM), the first of them: the hit's window
    KV was never cached."""
    if r.recomputed_rows > 0:
        return r.cached_len
    return max(0, r.context_len - window)


def kept_start(r: RequestSpec, kept: int, window: int, floor: int = 0) -> int:
    """``kept_kv_start``: seq_len when the request keeps no row; otherwise the highest of its
    batch start, its decoder floor (``decoder_floor``) and, when it loses rows, its first kept
    position ``seq_len - kept``."""
    if kept == 0:
        return r.seq_len
    lowest = [batch_start(r, window), floor]
    if kept < r.query_len:
        lowest.append(r.seq_len - kept)
    return max(lowest)


def smallest_capture_size(tokens: int, sizes: Sequence[int]) -> int | None:
    fitting = [s for s in sizes if s >= tokens]
    return min(fitting) if fitting else None


def replay_capture_size_table(window: int, max_capture_size: int, max_num_seqs: int) -> list[int]:
    """Issue 34's replay capture sizes restated as a membership test: ``s`` is on the grid when
    it is ``W + j * max(W, 2^k / 8)`` from the start of the stretch of interval ``[2^k, 2^(k+1))``
    it lies in, walking one size at a time; the bound is always the last size."""
    bound = min(max_capture_size, max_num_seqs * window)
    table = [window] if window < bound else []
    for s in range(window + 1, bound):
        prev = table[-1]
        interval = 1
        while interval * 2 <= prev:
            interval *= 2
        if s - prev == max(window, interval // 8):
            table.append(s)
    return [*table, bound]


@dataclass(frozen=True)
class Expected:
    """What the SPEC says a step does. ``kept_lens`` are the policy's, whatever the route;
    ``rows`` are the replay batch's batch rows (empty when the decoder runs on every row)."""

    graph_size: int | None
    replays: bool
    shape_mode: str
    kept_lens: tuple[int, ...]
    rows: tuple[int, ...]
    batch_starts: tuple[int, ...]
    kept_starts: tuple[int, ...]
    num_tokens: int
    reason: str
    # The replay batch runs in the replay graph of this many rows: the kept rows, then copies of
    # batch row 0 under the dummy request (None: unpadded, eager).
    replay_graph_size: int | None = None

    @property
    def trims(self) -> bool:
        return sum(self.kept_lens) < self.num_tokens

    @property
    def window_starts(self) -> tuple[int, ...]:
        """Where the decoder layers' windows start on the route taken."""
        return self.kept_starts if self.replays else self.batch_starts

    @property
    def kept_rows(self) -> tuple[int, ...]:
        """Rows whose decoder outputs count: every row unless the step replays."""
        return self.rows if self.replays else tuple(range(self.num_tokens))


def expect_step(
    requests: Sequence[RequestSpec],
    *,
    policy: str,
    graph_mode: str,
    window: int,
    decoder_layers: int,
    max_logit_rows: int,
    capture_sizes: Sequence[int] = (),
    trim_threshold: int | None = None,
    eager_trim_threshold: int = 0,
    halo_align: int = 1,
    replay_capture_sizes: Sequence[int] = (),
    kv_block_reuse: bool = False,
    lora: bool = False,
    prompt_embeds: bool = False,
) -> Expected:
    """The step as SPEC sections 2 and 4 describe it; a replay batch in PIECEWISE mode pads to
    the smallest replay capture size holding its rows (issue 34), none above the largest.
    The engine gates (issue 30): block reuse replays nothing (TensorRT-LLM); LoRA and prompt
    embeddings leave replay batches without graphs (vLLM); prompt embeddings are no text prefill,
    which ``tail`` alone replays (ATOM)."""
    query = [r.query_len for r in requests]
    tokens = sum(query)
    kept = [kept_len(r, policy, window, decoder_layers, halo_align) for r in requests]
    floors = [decoder_floor(r, policy, window) for r in requests]
    trims = any(k < q for k, q in zip(kept, query, strict=True))
    # a request keeping every row whose floor hides part of its batch window needs the replay
    # batch: only there do its decoder layers read from the floor
    floored = any(f > batch_start(r, window) for r, f in zip(requests, floors, strict=True))
    logit_rows = sum(r.query_len if (r.prompt_logprobs or r.context_logits
                                     or r.spec_decode_tokens) else 1 for r in requests)
    size = None
    if graph_mode != "eager" and logit_rows <= max_logit_rows:
        size = smallest_capture_size(tokens, capture_sizes)
    threshold = window + 1 if trim_threshold is None else trim_threshold
    if policy == "full":
        replays, reason = False, "policy full"
    elif kv_block_reuse:
        replays, reason = False, "KV block reuse: no replay"
    elif policy == "tail" and prompt_embeds:
        replays, reason = False, "tail: prompt embeddings are not text"
    elif size is not None and policy == "tail":
        # ROCm ATOM (DecoderReplayModel._replays): only an eager, unpadded text prefill replays
        replays, reason = False, "tail: ATOM replays no graph step"
    elif size is not None and graph_mode == "full":
        replays, reason = False, "FULL graph: nothing trims"
    elif size is not None:
        replays = size >= threshold
        reason = f"PIECEWISE graph {size} {'>=' if replays else '<'} trim_threshold {threshold}"
    elif floored:
        replays, reason = True, "eager: a final_window floor above a batch start"
    elif tokens < eager_trim_threshold:
        replays, reason = False, f"eager step below eager_trim_threshold {eager_trim_threshold}"
    else:
        replays = trims
        reason = "eager: some request loses rows" if trims else "eager: nothing to trim"
    rows: list[int] = []
    start = 0
    for q, k in zip(query, kept, strict=True):
        if replays:
            rows += list(range(start + q - k, start + q))
        start += q
    replay_size = None
    if replays and graph_mode == "piecewise" and not (lora or prompt_embeds):
        replay_size = smallest_capture_size(len(rows), replay_capture_sizes)
    return Expected(
        replay_graph_size=replay_size,
        graph_size=size,
        replays=replays,
        shape_mode="static" if size is not None and graph_mode == "full" else "varlen",
        kept_lens=tuple(kept),
        rows=tuple(rows),
        batch_starts=tuple(batch_start(r, window) for r in requests),
        kept_starts=tuple(kept_start(r, k, window, f)
                          for r, k, f in zip(requests, kept, floors, strict=True)),
        num_tokens=tokens,
        reason=reason,
    )


def expect_for(engine: Engine, requests: Sequence[RequestSpec]) -> Expected:
    """``expect_step`` with an engine's configuration and model sizes."""
    c, args = engine.config, engine.args
    return expect_step(
        requests,
        policy=c.policy,
        graph_mode=c.graph_mode,
        window=args.window,
        decoder_layers=args.n_decoder_layers,
        max_logit_rows=engine.logit_slots,
        capture_sizes=c.capture_sizes or (),
        trim_threshold=c.trim_threshold,
        eager_trim_threshold=c.eager_trim_threshold,
        halo_align=c.halo_align,
        replay_capture_sizes=c.replay_capture_sizes,
        kv_block_reuse=c.kv_block_reuse,
        lora=c.lora,
        prompt_embeds=c.prompt_embeds,
    )


# --- the step through the model, with the oracle's rows and metadata --------------------------


def _kept_layouts(step: StepBatch, exp: Expected) -> list[RequestLayout]:
    out, start = [], 0
    for lay, k, ks in zip(step.metadata.layouts, exp.kept_lens, exp.kept_starts, strict=True):
        first = lay.seq_len - k
        out.append(RequestLayout(
            cache_index=lay.cache_index, q_start=start, q_len=k, q_first_pos=first,
            kv_start=start, kv_len=k, kv_first_pos=first, window_start=ks,
            seq_len=lay.seq_len,
        ))
        start += k
    return out


def kept_row_context(
    step: StepBatch, exp: Expected, args: ModelArgs, cache: KVCache, kernels: Kernels
) -> ForwardContext:
    """The context the rest of S and the decoder run under on the kept rows: decoder layers see
    the kept rows as their keys, window starts at the kept starts; layer S's queries are the kept
    rows but its keys are every batch row (it wrote KV for all), window starts at the batch's.
    On ``kernels``, the engine's, as its replay batch runs. Padded to a replay graph's size, the
    rows after the kept ones belong to the dummy request and the per-request arrays cover every
    request slot (a graph's static metadata has one shape)."""
    kept = _kept_layouts(step, exp)
    n = len(exp.rows) if exp.replay_graph_size is None else exp.replay_graph_size
    slots = None if exp.replay_graph_size is None else args.max_requests + 1
    device = step.input_ids.device
    decoder = make_metadata(kept, num_q_rows=n, num_kv_rows=n, args=args, device=device,
                            num_request_slots=slots)
    first = [
        replace(b, q_start=k.q_start, q_len=k.q_len, q_first_pos=k.q_first_pos)
        for b, k in zip(step.metadata.layouts, kept, strict=True)
    ]
    s_meta = make_metadata(
        first, num_q_rows=n, num_kv_rows=step.num_padded, args=args, device=device,
        num_request_slots=slots,
    )
    return ForwardContext(
        attn_metadata=decoder,
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
        cache=cache,
        kernels=kernels,
        layer_metadata={args.last_kv_source: s_meta},
    )


@dataclass
class KeptRows:
    """The oracle's replay route (``ForwardContext.replay_batch``): gather the oracle's rows ->
    the layers under ``context`` -> scatter with zeros at trimmed rows.

    The per-row carry restated by name: the layers take each kept row's streams entering S, the
    pre-mix S's attention collapses them with (the previous block's FFN pre), and S's publications
    from its indexer on every batch row (its top-k selection and, with two-level candidates, its
    candidate blocks), so the kept row ``j`` reads batch row ``rows[j]``'s; they give back its final
    streams and final pre-mix; ``context`` then holds what the kept rows read (E1 compares it
    bitwise)."""

    rows: torch.Tensor
    context: ForwardContext
    hc: int
    padded_to: int | None = None  # a replay graph's size: rows after the kept ones read row 0

    def run(self, run_layers: Callable, kv_s: torch.Tensor, *inputs: torch.Tensor,
            out: tuple[torch.Tensor, ...] | None = None):
        """``out``: where the scattered outputs go (the route's contract; the oracle runs
        eagerly, where nothing passes it)."""
        given = ReplayInputs.of(self.hc, inputs)
        if given.pre_mix.shape != (kv_s.shape[0], self.hc) or given.pre_mix.dtype != torch.float32:
            raise ValueError(f"the pre-mix is fp32 [rows, {self.hc}], got "
                             f"{given.pre_mix.dtype} {tuple(given.pre_mix.shape)}")
        rows = self.rows
        if self.padded_to is not None:
            rows = torch.cat([rows, rows.new_zeros(self.padded_to - rows.shape[0])])
        picked = ReplayInputs(tuple(s.index_select(0, rows) for s in given.streams),
                              given.pre_mix.index_select(0, rows),
                              tuple(p.index_select(0, rows) for p in given.publications))
        with set_forward_context(self.context):
            final = ReplayOutputs.of(self.hc, run_layers(kv_s, *picked.tensors()))
        n = self.rows.shape[0]
        final = ReplayOutputs(tuple(s[:n] for s in final.streams), final.pre_mix[:n],
                              None if final.aux_hidden is None else final.aux_hidden[:n])
        aux = final.aux_hidden
        spread = ReplayOutputs(tuple(self._scatter(kv_s, s) for s in final.streams),
                               self._scatter(kv_s, final.pre_mix),
                               None if aux is None else self._scatter(kv_s, aux))
        if out is None:
            return spread.tensors()
        return tuple(buf.copy_(t) for buf, t in zip(out, spread.tensors(), strict=True))

    def _scatter(self, kv_s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return t.new_zeros((kv_s.shape[0], *t.shape[1:])).index_copy_(0, self.rows, t)


@dataclass
class OracleOutput:
    logits: torch.Tensor
    streams: tuple[torch.Tensor, ...]
    pre_mix: torch.Tensor  # the final pre-mix of every real row (zeros at trimmed rows)
    step: StepBatch
    expected: Expected
    # The kept rows' context when the step replays: its index selections (row j is batch row
    # ``expected.rows[j]``) and recorded index queries.
    kept_context: ForwardContext | None = None
    # DSpark's aux hidden states of every real row (None without draft layers).
    aux_hidden: torch.Tensor | None = None


def oracle_forward(
    engine: Engine,
    requests: Sequence[RequestSpec],
    tokens: Sequence[Sequence[int]],
    cache_indices: Sequence[int] | None,
    expected: Expected,
) -> OracleOutput:
    """The step on ``engine``'s model and cache as ``expected`` says it runs: eagerly at its
    padded shape, shape mode and kernels (a graph replays exactly these kernels), with the
    oracle's kept rows and window starts. Only the model's packing (``Engine.prepare``) is
    shared."""
    step = engine.prepare(requests, tokens, cache_indices, pad_to=expected.graph_size)
    kept = kept_ctx = None
    if expected.replays:
        rows = torch.tensor(expected.rows, dtype=torch.long, device=step.input_ids.device)
        kept_ctx = kept_row_context(step, expected, engine.args, engine.cache, engine.kernels)
        kept_ctx.index_queries = {}
        kept = KeptRows(rows, kept_ctx, engine.args.hc_mult, expected.replay_graph_size)
    ctx = ForwardContext(
        attn_metadata=step.metadata,
        logits_indices=step.logits_indices,
        cache=engine.cache,
        kernels=engine.kernels,
        shape_mode=expected.shape_mode,
        replay_batch=kept,
    )
    with torch.inference_mode(), set_forward_context(ctx):
        logits, streams, pre_mix, aux = engine.model(step.input_ids)
    return OracleOutput(
        logits[: step.num_logits], tuple(s[: step.num_tokens] for s in streams),
        pre_mix[: step.num_tokens], step, expected, kept_ctx,
        None if aux is None else aux[: step.num_tokens],
    )


def bounded_reference_metadata(
    step: StepBatch, exp: Expected, args: ModelArgs
) -> dict[int, AttentionMetadata]:
    """Decoder-layer metadata of the full-batch bounded reference (SPEC E1): every row, windows
    masked below the oracle's kept starts, ring slots written only by kept rows. Layer S keeps the
    batch metadata; the DSpark draft layers (``n_layers ..``) take the decoder's, their rings too
    written only by kept rows. For ``Engine.reference_step(layer_metadata=...)`` on an unpadded
    step."""
    layouts = [
        replace(lay, window_start=ks)
        for lay, ks in zip(step.metadata.layouts, exp.window_starts, strict=True)
    ]
    meta = make_metadata(
        layouts, num_q_rows=step.num_padded, num_kv_rows=step.num_padded, args=args,
        device=step.input_ids.device, num_request_slots=step.metadata.window_start.shape[0],
    )
    keep = torch.zeros(step.num_padded, dtype=torch.bool)
    keep[list(exp.kept_rows)] = True
    trash = args.max_requests * args.window
    meta.ring_slot = torch.where(keep.to(meta.ring_slot.device), meta.ring_slot, trash)
    return {layer: meta
            for layer in range(args.last_kv_source + 1, args.n_layers + args.dspark_layers)}


# --- the indexer's causal visibility ------------------------------------------------------


def visible_key_count(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many of a KV source's global keys a query row at each position may read (SPEC 1b and
    DeepSeek-V4.1 ``Indexer.forward``'s causal mask), derived from what a key is rather than
    taken from the model's ``key_sources``: key ``j`` pools the ``ratio`` positions
    ``j r .. j r + r - 1`` (at ratio 1, position ``j`` alone) and exists once its last one has
    been seen, so the row at ``t`` reads keys ``0 .. floor((t - (r - 1)) / r)``, none while its
    first group is still open. A real row lies inside its sequence, so each of those groups began
    there too. ``positions``: the real rows' positions, long."""
    newest = torch.div(positions - (ratio - 1), ratio, rounding_mode="floor")
    return (newest + 1).clamp(min=0)
