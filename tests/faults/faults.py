"""Seeded faults in the replay code, each a realistic bug, applied by monkeypatching.

Every fault names the shipped CPU scenario case that must catch it: ``swa-bench check`` on that
case (``CaseRunner.run_checks``) has to fail. The README's fault table is this list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import swa_bench.engine.dispatch as dispatch
import swa_bench.engine.engine as engine_mod
import swa_bench.graphs.capture as capture
import swa_bench.model.attention as attention
import swa_bench.model.key_sources as key_sources
import swa_bench.model.sparse_attention as sparse_attention
import swa_bench.replay.replay_batch as replay_batch
import swa_bench.replay.row_selection as row_selection
from swa_bench.model.forward_context import get_forward_context, region, set_forward_context

SMOKE, COVERAGE = "scenarios/smoke.yaml", "scenarios/coverage.yaml"
# Cases by label, so a reordered sweep cannot point a fault at a case it does not reach.
EAGER_BOUNDED, EAGER_HALO = "eager/bounded/T=95", "eager/halo/T=95"
PIECEWISE_BOUNDED, FULL_BOUNDED = "piecewise/bounded/T=95", "full/bounded/T=95"
COV_EAGER = "eager/bounded/T=87/halo_align=1/eager_trim_threshold=0/n_layers=8"
COV_PIECEWISE_AT_THRESHOLD = "piecewise/bounded/T=87/halo_align=1/eager_trim_threshold=0/n_layers=8"
COV_HALO_ALIGNED = "eager/halo/T=87/halo_align=4/eager_trim_threshold=0/n_layers=8"
COV_EAGER_THRESHOLD = "eager/bounded/T=87/halo_align=1/eager_trim_threshold=96/n_layers=8"
# S's indexer runs before the cut: an index source on the replay batch is one after S (layer 7).
SPARSE, SPARSE_EAGER_BOUNDED = "scenarios/sparse-policies.yaml", "eager/bounded/T=37"
PRECISION, FP8_EAGER_BOUNDED = ("scenarios/precision.yaml",
                                "eager/bounded/T=61/precision=fp8/expert_precision=w4a8")


@dataclass(frozen=True)
class Fault:
    name: str
    breaks: str
    apply: Callable  # (monkeypatch) -> None
    case: tuple[str, str]  # (scenario file, case label)


def _kept_len_fault(rule):
    real = row_selection.kept_len

    def apply(mp):
        def kept_len(request, policy, window, halo):
            return rule(real, request, policy, window, halo)

        mp.setattr(row_selection, "kept_len", kept_len)

    return apply


def _window_start_fault(shift):
    real = replay_batch.kept_window_start

    def apply(mp):
        def kept_window_start(replay_start, seq_len, kept, query_len):
            start = real(replay_start, seq_len, kept, query_len)
            return start + shift if kept < query_len else start

        mp.setattr(replay_batch, "kept_window_start", kept_window_start)

    return apply


def into(out, tensors):
    """A faulty route's outputs in the graph break's buffers (``ReplayBatch.run``'s ``out``)."""
    return tuple(buf.copy_(t) for buf, t in zip(out, tensors, strict=True))


def _replay_route(gather_rows=None, scatter_rows=None, base=None):
    """A faulty gather/scatter around the replay layers (the model's eager break still wraps it)."""

    def apply(mp):
        def run(self, run_layers, batch_kv, *inputs, out=None):
            ctx = get_forward_context()
            rows = self.rows
            g = rows if gather_rows is None else gather_rows(rows)
            with region(ctx.timer, "gather"):
                gathered = [None if t is None else t.index_select(0, g) for t in inputs]
            with set_forward_context(self.forward_context):
                outputs = run_layers(batch_kv, *gathered)
            s = rows if scatter_rows is None else scatter_rows(rows)
            spread = []
            for i, o in enumerate(outputs):
                start = (o.new_zeros((batch_kv.shape[0], *o.shape[1:])) if base is None
                         else base(inputs, i))
                spread.append(start.index_copy_(0, s, o))
            return tuple(spread) if out is None else into(out, spread)

        mp.setattr(replay_batch.ReplayBatch, "run", run)

    return apply


def _replay_batch_fault(edit):
    real = engine_mod.build_replay_batch

    def apply(mp):
        def build(step, lens, args, cache, kernels, **floors):
            rb = real(step, lens, args, cache, kernels, **floors)
            edit(rb, step, args)
            return rb

        mp.setattr(engine_mod, "build_replay_batch", build)

    return apply


def _plan_fault(edit):
    real = engine_mod.plan_step

    def apply(mp):
        def plan_step(requests, config, args, *, capture_size=None):
            plan = real(requests, config, args, capture_size=capture_size)
            return edit(plan, requests, config) or plan

        mp.setattr(engine_mod, "plan_step", plan_step)

    return apply


def _whole_batch(plan, requests, reason):
    query = tuple(r.query_len for r in requests)
    return dataclasses.replace(plan, replays=False, kept_lens=query, reason=reason)


def _threshold_exclusive(plan, requests, config):
    if plan.graph_size is not None and plan.graph_size == config.trim_threshold:
        return _whole_batch(plan, requests, "fault: size == threshold does not replay")
    return None


def _eager_threshold_ignored(plan, requests, config):
    if plan.graph_size is None and not plan.replays and config.policy != "full":
        lens = dispatch.policy_kept_lens(requests, config, dispatch_args(requests, config))
        if sum(lens) < plan.num_tokens:
            return dataclasses.replace(plan, replays=True, kept_lens=lens)
    return None


_ARGS = {}


def dispatch_args(requests, config):
    return _ARGS["args"]


def _remember_args(mp):
    real = engine_mod.plan_step

    def plan_step(requests, config, args, *, capture_size=None):
        _ARGS["args"] = args
        return real(requests, config, args, capture_size=capture_size)

    mp.setattr(engine_mod, "plan_step", plan_step)


def _eager_threshold_apply(mp):
    _remember_args(mp)
    _plan_fault(_eager_threshold_ignored)(mp)


def _piecewise_no_replay_batch(mp):
    real = engine_mod.Engine.forward_context

    def forward_context(self, step, plan, cache, timer=None):
        ctx = real(self, step, plan, cache, timer)
        if plan.graph_size is not None:
            ctx.replay_batch = None
        return ctx

    mp.setattr(engine_mod.Engine, "forward_context", forward_context)


def _full_graph_stale(mp):
    real = capture.CapturedGraphs.load
    loaded: set = set()

    def load(self, step, size):
        if self.mode == "full" and (id(self), size) in loaded:
            return dataclasses.replace(self.static_steps[size], requests=step.requests,
                                       num_logits=step.num_logits, num_tokens=step.num_tokens)
        loaded.add((id(self), size))
        return real(self, step, size)

    mp.setattr(capture.CapturedGraphs, "load", load)


def _indexer_wrong_rows(mp):
    """On the replay batch, each query row is given its neighbour's index scores."""
    real = sparse_attention.select_top_k

    def select_top_k(scores, visible, top_k):
        if get_forward_context().logits_indices.numel() == 0 and scores.shape[0] > 1:
            scores = scores.roll(1, 0)
        return real(scores, visible, top_k)

    mp.setattr(sparse_attention, "select_top_k", select_top_k)


def visibility_off_by_one(mp):
    """The causal visibility one short, ``j < t // r`` (``j < t`` at ratio 1) where the rule is
    ``j < (t + 1) // r``: in ``key_sources.visible_counts`` and where the indexer and attention
    bound it, so every path (engine, oracle forward, references) moves together."""
    real = key_sources.visible_counts

    def visible_counts(positions, seq_len, ratio):
        return real(positions - 1, seq_len, ratio)

    for module in (key_sources, sparse_attention, attention):
        mp.setattr(module, "visible_counts", visible_counts)


def _layer_s_kept_starts(rb, step, args):
    meta = rb.forward_context.layer_metadata[args.last_kv_source]
    meta.window_start = rb.forward_context.attn_metadata.window_start.clone()


def _ring_slots_shifted(rb, step, args):
    meta = rb.forward_context.attn_metadata
    meta.ring_slot = meta.ring_slot.roll(1, 0)


def _ring_writes_dropped(rb, step, args):
    meta = rb.forward_context.attn_metadata
    meta.ring_slot = torch.full_like(meta.ring_slot, args.max_requests * args.window)


def _cache_index_batch_order(mp):
    real = replay_batch.kept_layouts

    def kept_layouts(step, lens, floors=None):
        return [dataclasses.replace(lay, cache_index=i)
                for i, lay in enumerate(real(step, lens, floors))]

    mp.setattr(replay_batch, "kept_layouts", kept_layouts)


def _kept_rows_first(mp):
    def kept_rows(requests, lens):
        starts = row_selection.query_starts(requests)
        return [starts[i] + j for i, k in enumerate(lens) for j in range(k)]

    mp.setattr(replay_batch, "kept_rows", kept_rows)


def _kept_rows_no_offsets(mp):
    def kept_rows(requests, lens):
        rows, end = [], 0
        for k in lens:
            end += k
            rows.extend(range(end - k, end))
        return rows

    mp.setattr(replay_batch, "kept_rows", kept_rows)


def _halo_plus(delta, ignore_align=False):
    real = dispatch.halo_size

    def apply(mp):
        def halo_size(window, layers, align=1):
            return real(window, layers, 1 if ignore_align else align) + delta

        mp.setattr(dispatch, "halo_size", halo_size)

    return apply


def _padded_next(mp):
    real = dispatch.padded_size

    def padded_size(tokens, sizes):
        size = real(tokens, sizes)
        bigger = [s for s in sizes if size is not None and s > size]
        return bigger[0] if bigger else size

    mp.setattr(dispatch, "padded_size", padded_size)


def _shift_rows(rows):
    return (rows + 1).clamp_max(int(rows.max()))


def _gather_before(rows):
    return (rows - 1).clamp_min(0)


FAULTS = [
    Fault("bounded keeps W+1", "kept length, applied consistently (plan, rows, starts)",
          _kept_len_fault(lambda real, r, p, w, h: min(r.query_len, w + 1)
                          if p == "bounded" and not r.decode and not r.prompt_logprobs
                          else real(r, p, w, h)),
          (SMOKE, EAGER_BOUNDED)),
    Fault("halo H+1", "halo size", _halo_plus(1), (SMOKE, EAGER_HALO)),
    Fault("halo ignores halo_align", "halo rounding", _halo_plus(0, ignore_align=True),
          (COVERAGE, COV_HALO_ALIGNED)),
    Fault("trims() says no step trims", "route: no replay batch in eager",
          lambda mp: mp.setattr(dispatch, "trims", lambda requests, lens: False),
          (SMOKE, EAGER_BOUNDED)),
    Fault("prompt-logprob requests trimmed", "logprob rows zeroed",
          _kept_len_fault(lambda real, r, p, w, h: real(dataclasses.replace(
              r, prompt_logprobs=False), p, w, h)),
          (COVERAGE, COV_EAGER)),
    Fault("middle chunk keeps no rows", "chunked prefill under bounded",
          _kept_len_fault(lambda real, r, p, w, h: 0 if p == "bounded" and not r.decode
                          and r.cached_len + r.query_len < r.prompt_len else real(r, p, w, h)),
          (SMOKE, EAGER_BOUNDED)),
    Fault("kept start +1", "off-by-one kept_kv_start", _window_start_fault(1),
          (SMOKE, EAGER_BOUNDED)),
    Fault("kept start -1", "off-by-one kept_kv_start", _window_start_fault(-1),
          (SMOKE, EAGER_BOUNDED)),
    Fault("kept start ignores the batch start", "prefix hit keeping every row reads below H-W",
          lambda mp: mp.setattr(replay_batch, "kept_window_start",
                                lambda rs, seq, k, q: 0 if k >= q else max(0, seq - k)),
          (COVERAGE, COV_EAGER)),
    Fault("rows in batch-order cache slots", "cache index != batch position",
          _cache_index_batch_order, (COVERAGE, COV_EAGER)),
    Fault("indexer reads wrong query rows", "top-k on the replay batch",
          _indexer_wrong_rows, (SPARSE, SPARSE_EAGER_BOUNDED)),
    Fault("indexer visibility j < t", "causal visibility off by one on every path",
          visibility_off_by_one, (SPARSE, SPARSE_EAGER_BOUNDED)),
    Fault("padded exactly to trim_threshold does not replay", "threshold comparison",
          _plan_fault(_threshold_exclusive), (COVERAGE, COV_PIECEWISE_AT_THRESHOLD)),
    Fault("eager_trim_threshold ignored", "eager threshold", _eager_threshold_apply,
          (COVERAGE, COV_EAGER_THRESHOLD)),
    Fault("trimmed rows keep their input streams", "zeros at trimmed rows",
          _replay_route(base=lambda inputs, i: inputs[i].clone()), (SMOKE, EAGER_BOUNDED)),
    Fault("scatter to shifted rows", "scatter", _replay_route(scatter_rows=_shift_rows),
          (SMOKE, EAGER_BOUNDED)),
    Fault("gather from the row before", "gather", _replay_route(gather_rows=_gather_before),
          (SMOKE, EAGER_BOUNDED)),
    Fault("kept rows are the first, not the last", "row selection", _kept_rows_first,
          (SMOKE, EAGER_BOUNDED)),
    Fault("kept rows ignore request offsets", "row selection", _kept_rows_no_offsets,
          (SMOKE, EAGER_BOUNDED)),
    Fault("decoder ring slots shifted by a row", "ring writes on the replay batch",
          _replay_batch_fault(_ring_slots_shifted), (SMOKE, EAGER_BOUNDED)),
    Fault("decoder ring writes dropped", "stale decoder rings after replay",
          _replay_batch_fault(_ring_writes_dropped), (SMOKE, EAGER_BOUNDED)),
    Fault("layer S with kept starts", "layer S window on the replay batch",
          _replay_batch_fault(_layer_s_kept_starts), (SMOKE, EAGER_BOUNDED)),
    Fault("replay batch not built in PIECEWISE", "PIECEWISE route",
          _piecewise_no_replay_batch, (SMOKE, PIECEWISE_BOUNDED)),
    Fault("FULL graph replays a stale static step", "graph inputs not loaded",
          _full_graph_stale, (SMOKE, FULL_BOUNDED)),
    Fault("step padded to the next capture size", "dispatch padding", _padded_next,
          (SMOKE, PIECEWISE_BOUNDED)),
    Fault("fp8 kept start +1", "off-by-one kept_kv_start under the release's numerics",
          _window_start_fault(1), (PRECISION, FP8_EAGER_BOUNDED)),
]

from tests.faults.pre_mix import PRE_MIX_FAULTS  # noqa: E402  (it builds on Fault above)

FAULTS += PRE_MIX_FAULTS
