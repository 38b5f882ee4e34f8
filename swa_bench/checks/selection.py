"""Top-k selections of a replay against its full-batch truth (sparse models, E1 and E2).

The replay batch computes its index queries at other GEMM shapes than the full batch, so a
position scored within rounding of a row's k-th best can fall on the other side of the cut. The
two paths then attend to sets that differ by a near-tie, and their outputs differ at that row by
more than rounding (on the H200, v41-flash at 16K tokens in bf16: 2 of 524288 kept-row elements at
1.12x the envelope, the rest far inside it). So the truth is judged in two parts:

* each row whose selection differs must differ by a near-tie: every position one side chose and
  the other did not scores, under the truth's own scores, within the rounding envelope of the
  truth's k-th score (``near_tie_ratio`` <= 1). A selection that differs beyond that fails;
* the truth then runs again with the replay's selection at the kept rows (``given``), and the
  outputs are compared on equal selections within the envelope, as for a dense model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swa_bench.checks.comparison import Tolerance, check_result, envelope_tolerance
from swa_bench.checks.oracle import OracleOutput, smallest_capture_size, visible_key_count
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput, run_forward
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import StepBatch
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ForwardContext
from swa_bench.model.key_sources import visible_global_keys
from swa_bench.model.model import Transformer
from swa_bench.model.sparse_attention import candidate_mask, index_scores
from swa_bench.results import CheckResult, Diagnostic


def near_tie_ratio(
    scores: torch.Tensor, chosen: set[int], truth: set[int], top_k: int, tol: Tolerance
) -> float:
    """How far outside rounding ``chosen`` departs from the truth's top-k ``truth`` under the
    truth's ``scores`` (one row, visible positions only): the largest distance of a differing
    position from the truth's k-th score, over ``atol + rtol |k-th|``. 0 when the sets agree;
    infinite when they differ in size or one side chose a position the other could not see."""
    if chosen == truth:
        return 0.0
    n = scores.shape[0]
    if len(chosen) != len(truth) or any(p < 0 or p >= n for p in chosen | truth):
        return math.inf
    s = scores.double()
    kth = float(s.topk(min(top_k, n)).values[-1])
    allowance = tol.atol + tol.rtol * abs(kth)
    gaps = [kth - float(s[p]) for p in chosen - truth] + [float(s[p]) - kth for p in truth - chosen]
    return max(max(gaps), 0.0) / allowance


@dataclass
class SelectionComparison:
    """The replayed index sources' selections against the truth's."""

    rows_compared: int = 0  # (kept row, index source) pairs
    rows_differing: int = 0
    worst_ratio: float = 0.0  # of near_tie_ratio over the differing rows
    diagnostics: list[Diagnostic] = field(default_factory=list)
    # Selections for the truth's second run: its own, with the replay's at the kept rows; empty
    # when every selection agreed (the first run is then the comparison).
    given: dict[int, torch.Tensor] = field(default_factory=dict)

    def note(self) -> str:
        if not self.rows_compared:
            return ""
        if not self.rows_differing:
            return f"; top-k selections equal on {self.rows_compared} (row, index source) pairs"
        return (f"; top-k selections differ on {self.rows_differing} of {self.rows_compared} "
                f"(row, index source) pairs, worst {self.worst_ratio:.3g} of the near-tie "
                f"allowance, outputs compared on the replay's selection")


def compare_selections(
    ora: OracleOutput, truth: StepOutput, cache: KVCache, dtype: torch.dtype,
    tol: Tolerance | None = None, compared: dict[int, list[int]] | None = None,
) -> SelectionComparison:
    """Compares the oracle's kept-row selections with the truth's (``truth`` run with
    ``record_index_queries``; ``cache`` the truth's after its step, holding the index keys).
    ``tol`` overrides the envelope of each row's scores. ``compared[layer]`` lists the kept rows
    (indices into ``ora.expected.rows``) whose input to that layer the truth computes alike
    (default: all); the others keep the truth's own selection."""
    out = SelectionComparison()
    kept = ora.kept_context
    if kept is None or not kept.index_selection or truth.context is None:
        return out
    meta = truth.step.metadata
    rows = torch.tensor(ora.expected.rows, dtype=torch.long)
    positions, requests = meta.positions.cpu(), meta.row_request.cpu()
    subsets: dict[int, torch.Tensor] = {}
    for layer, mine in sorted(kept.index_selection.items()):
        theirs = truth.context.index_selection[layer]
        query = truth.context.index_queries[layer]
        subset = torch.arange(len(rows)) if compared is None else torch.tensor(
            compared[layer], dtype=torch.long)
        subsets[layer] = subset
        ours_rows = mine[: len(rows)].cpu()
        theirs_rows = theirs.index_select(0, rows.to(theirs.device)).cpu()
        differ = torch.zeros(len(rows), dtype=torch.bool)
        differ[subset] = (ours_rows[subset].sort(-1).values
                          != theirs_rows[subset].sort(-1).values).any(-1)
        out.rows_compared += len(subset)
        beyond, worst, worst_row = 0, 0.0, -1
        for j in differ.nonzero().flatten().tolist():
            row = int(rows[j])
            pos, lay = int(positions[row]), meta.layouts[int(requests[row])]
            keys = cache.index_key_rows(query.source, lay.cache_index, pos + 1)
            scores = index_scores(query.q[row : row + 1], query.weights[row : row + 1], keys)[0]
            if query.within is not None:  # after S: only the truth's candidate positions count
                allowed = candidate_mask(query.within[row : row + 1], scores.shape[0],
                                         query.block_size)[0]
                scores = scores.masked_fill(~allowed, float("-inf"))
            ratio = near_tie_ratio(
                scores, {p for p in ours_rows[j].tolist() if p >= 0},
                {p for p in theirs_rows[j].tolist() if p >= 0}, query.top_k,
                tol or envelope_tolerance(scores, dtype),
            )
            out.rows_differing += 1
            out.worst_ratio = max(out.worst_ratio, ratio)
            if ratio > 1.0:
                beyond += 1
                if ratio > worst or worst_row < 0:
                    worst, worst_row = ratio, row
        if beyond:
            out.diagnostics.append(Diagnostic(
                tensor=f"selection.layer{layer}: top-k differs beyond a near-tie (max rel = "
                f"distance from the k-th score / allowance)", mismatched=beyond,
                total=len(subset), share=beyond / len(subset), max_abs=0.0, max_rel=worst,
                worst_index=[worst_row],
            ))
    if out.rows_differing:
        for layer, mine in kept.index_selection.items():
            given = truth.context.index_selection[layer].clone()
            at = rows[subsets[layer]].to(given.device)
            given.index_copy_(0, at, mine[: len(rows)][subsets[layer]].to(given.device))
            out.given[layer] = given
    return out


# --- visibility: what each row may select, against the oracle's restatement ------------------


def _rows_diagnostic(name: str, bad: torch.Tensor, positions: torch.Tensor, detail: str
                     ) -> Diagnostic | None:
    """The rows (real rows of one forward) where ``bad`` holds, as one diagnostic naming the
    first one's position."""
    n_bad = int(bad.sum())
    if not n_bad:
        return None
    first = int(bad.nonzero()[0, 0])
    return Diagnostic(tensor=f"{name}: {detail} (first at row {first}, position "
                      f"{int(positions[first])})", mismatched=n_bad, total=bad.numel(),
                      share=n_bad / bad.numel(), max_abs=0.0, max_rel=0.0, worst_index=[first])


VISIBILITY_ROW_CHUNK = 1024  # rows per pass: the per-position masks stay [chunk, keys]


def selection_visibility(prefix: str, selection: torch.Tensor, positions: torch.Tensor,
                          counts: torch.Tensor, query) -> list[Diagnostic | None]:
    """One index source's ``[rows, top_k]`` selection of the real rows against ``counts``, the
    oracle's visible keys per row: every chosen position distinct and visible (within the row's
    candidate blocks after S), and as many chosen as there are to choose, up to ``top_k`` (a
    score is finite at every visible position, so top-k never leaves one out for a pad)."""
    sel_all = selection.long().cpu()
    k = sel_all.shape[1]
    if not sel_all.shape[0]:
        return []
    within_all = None if query.within is None else query.within[: sel_all.shape[0]].long().cpu()
    invisible, repeated, taken, expected = [], [], [], []
    for r0 in range(0, sel_all.shape[0], VISIBILITY_ROW_CHUNK):
        sel = sel_all[r0 : r0 + VISIBILITY_ROW_CHUNK]
        n = counts[r0 : r0 + VISIBILITY_ROW_CHUNK]
        chosen = sel >= 0
        width = int(n.max()) + 1 if len(n) else 1
        visible = chosen & (sel < n[:, None])
        available = n
        if within_all is not None:  # after S: the row's candidate blocks' positions only
            size = query.block_size
            n_blocks = -(-width // size)
            within = within_all[r0 : r0 + VISIBILITY_ROW_CHUNK]
            listed = torch.zeros(len(sel), n_blocks + 1, dtype=torch.bool)
            listed.scatter_(1, torch.where((within >= 0) & (within < n_blocks), within,
                                           n_blocks), True)
            listed = listed[:, :n_blocks]
            starts = torch.arange(n_blocks)[None, :] * size
            in_block = (n[:, None] - starts).clamp(0, size)  # visible positions per block
            available = (in_block * listed).sum(-1)
            visible &= listed.gather(1, torch.where(visible, sel, 0) // size)
        member = torch.zeros(len(sel), width + 1, dtype=torch.bool)
        member.scatter_(1, torch.where(visible, sel, width), True)
        invisible.append((chosen & ~visible).any(-1))
        repeated.append(member[:, :width].sum(-1) < visible.sum(-1))
        taken.append(chosen.sum(-1))
        expected.append(available.clamp(max=k))
    invisible, repeated = torch.cat(invisible), torch.cat(repeated)
    taken, expected = torch.cat(taken), torch.cat(expected)
    return [
        _rows_diagnostic(f"{prefix}chose_invisible", invisible, positions,
                         "a chosen position the oracle's causal rule does not make visible"),
        _rows_diagnostic(f"{prefix}chose_repeated", repeated, positions,
                         "a position chosen twice"),
        _rows_diagnostic(f"{prefix}chosen_count", taken != expected, positions,
                         f"rows choosing other than min(top_k = {k}, visible) positions, e.g. "
                         + _first_pair(taken, expected)),
    ]


def _first_pair(got: torch.Tensor, want: torch.Tensor) -> str:
    """The first differing row's pair of figures, for the message."""
    bad = (got != want).nonzero()
    if not len(bad):
        return ""
    i = int(bad[0, 0])
    return f"{int(got[i])} where the oracle has {int(want[i])}"


def candidate_visibility(prefix: str, blocks: torch.Tensor, positions: torch.Tensor,
                          counts: torch.Tensor, block_size: int) -> list[Diagnostic | None]:
    """S's published candidate blocks ``[rows, width]`` against the oracle's visible counts:
    only blocks holding a visible position, the block of the newest visible position among them
    (pinned), and as many as there are up to ``width``."""
    b = blocks.long().cpu()
    listed = b >= 0
    reachable = -(-counts // block_size)
    newest = torch.div(counts - 1, block_size, rounding_mode="floor")
    pinned = (b == newest[:, None]).any(-1) | (counts == 0)
    return [
        _rows_diagnostic(f"{prefix}unreachable_block", (listed & (b >= reachable[:, None])
                                                        ).any(-1), positions,
                         "a listed block holds no position the oracle makes visible"),
        _rows_diagnostic(f"{prefix}newest_block_missing", ~pinned, positions,
                         "the block of the newest visible position is not listed"),
        _rows_diagnostic(f"{prefix}block_count", listed.sum(-1) != reachable.clamp(
            max=b.shape[1]), positions, "rows listing other than min(width, reachable) blocks"),
    ]


def visibility_diagnostics(prefix: str, args: ModelArgs, step: StepBatch,
                           context: ForwardContext) -> list[Diagnostic | None]:
    """A forward's visibility against ``oracle.visible_key_count`` on every real row: the visible
    counts its metadata gives each layer's global keys (``key_sources.visible_global_keys``, what
    dense attention and the indexer mask with), each index source's selection and S's candidate
    blocks. ``context`` ran ``step`` with ``index_queries`` recorded."""
    rows = step.num_tokens
    positions = step.metadata.positions[:rows].long().cpu()
    diags: list[Diagnostic | None] = []
    ratios = sorted({r for layer in range(args.n_layers)
                     if (r := args.compress_ratio_for(layer)) is not None})
    for ratio in ratios:
        want = visible_key_count(positions, ratio)
        got = visible_global_keys(step.metadata, ratio)[:rows].long().cpu()
        diags.append(_rows_diagnostic(f"{prefix}visible_keys.ratio{ratio}", got != want,
                                      positions, "visible global keys differ from the oracle's "
                                      "causal rule, e.g. " + _first_pair(got, want)))
    for layer, selection in sorted(context.index_selection.items()):
        query, ratio = context.index_queries[layer], args.compress_ratio_for(layer)
        if ratio is None:
            continue
        counts = visible_key_count(positions, ratio)
        diags += selection_visibility(f"{prefix}layer{layer}.", selection[:rows], positions,
                                       counts, query)
        if query.publishes is not None and context.candidates is not None:
            diags += candidate_visibility(f"{prefix}layer{layer}.candidates.",
                                           context.candidates[:rows], positions, counts,
                                           query.publishes.block_size)
    return diags


def check_visibility(model: Transformer, workload: StepInputs, config: EngineConfig
                     ) -> CheckResult:
    """Every row of the workload's step sees exactly the global keys the SPEC's causal rule gives
    it, restated in the oracle (``oracle.visible_key_count``), which shares nothing with the
    model's ``key_sources``: a visibility off by one there moves the engine, the oracle's
    forward, the bounded reference and the full prefill together, so E1-E5 cannot see it.

    The whole step runs once as the reference (every layer on every row, varlen shapes) and,
    when it fits one of the case's capture sizes and a graph's logits rows, once more at static
    shapes padded to it (the
    shapes a FULL graph of the step runs, whatever the case's graph mode: the static selection
    path then runs in every such case, not in FULL cases alone), on the case's kernels from the
    workload's caches; each forward's visible counts, index selections and candidate blocks are
    graded by ``visibility_diagnostics``."""
    tokens = sum(r.query_len for r in workload.requests)
    pad = smallest_capture_size(tokens, config.capture_sizes or ())
    # A graph returns at most max_requests logits rows: a step asking more (every-row logits of
    # prompt logprobs, context logits, verify rows) never runs at static shapes.
    if sum(r.query_len if r.every_row_logits else 1 for r in workload.requests) > \
            model.args.max_requests:
        pad = None
    modes = ["varlen"] + ([] if pad is None else ["static"])
    base = Engine(model, EngineConfig.for_model(model.args, policy="full",
                                                kernels=config.kernels))
    workload.fill_context(base)
    diags: list[Diagnostic | None] = []
    for mode in modes:
        engine = base  # the last forward runs on the filled caches, the others on copies
        if mode != modes[-1]:
            engine = Engine(model, base.config)
            engine.cache.copy_from(base.cache)
        step = engine.prepare(workload.requests, workload.step_tokens, workload.cache_indices,
                              pad_to=pad if mode == "static" else None)
        ctx = ForwardContext(attn_metadata=step.metadata, logits_indices=step.logits_indices,
                             cache=engine.cache, kernels=engine.kernels, shape_mode=mode,
                             index_queries={})
        run_forward(model, step, ctx)
        diags += visibility_diagnostics(f"{mode}.", model.args, step, ctx)
        del engine
    sources = len(model.args.index_source_list())
    note = (f"{' and '.join(modes)} forward of {workload.shape()}"
            + (f" (padded to {pad})" if pad is not None else "") + ": visible counts"
            + (f", {sources} index sources' selections" if sources else "")
            + " vs the oracle's causal rule")
    return check_result("visibility", "every row sees the SPEC's visible keys", diags, None,
                        note)
