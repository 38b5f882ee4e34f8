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

from swa_bench.checks.comparison import Tolerance, envelope_tolerance
from swa_bench.checks.oracle import OracleOutput
from swa_bench.engine.engine import StepOutput
from swa_bench.model.cache import KVCache
from swa_bench.model.sparse_attention import candidate_mask, index_scores
from swa_bench.results import Diagnostic


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
