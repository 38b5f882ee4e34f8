"""The equivalence checks E1-E5 (SPEC section 3).

Each check runs the engine of the case's configuration (its graph mode too) on caches filled with
the workload's context (the engine comes from ``engines``: the caller owns reuse, see
``EngineSource``), and grades it against ``oracle``: the step the SPEC describes, with rows,
window starts and route stated independently of the replay code. Against the oracle's forward
(same kernels, same shapes) a correct engine is **bitwise** equal on every row (zeros at trimmed
rows), the logits and every cache; the oracle's forward is then compared with the full-batch
truth (the bounded reference for E1, the full prefill for E2) within the rounding envelope of two
batch compositions of one function (``comparison.envelope_tolerance``), and that envelope is
reported. Checks run with TF32 off: they verify, they do not time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from swa_bench.checks import oracle
from swa_bench.checks.comparison import (
    Tolerance,
    check_result,
    compare,
    envelope_ratio,
    envelope_tolerance,
)
from swa_bench.checks.selection import SelectionComparison, compare_selections
from swa_bench.checks.tolerance import ENVELOPE, Allowance
from swa_bench.engine.config import EngineConfig
from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.engine.step_inputs import StepInputs, decode_requests
from swa_bench.kernels.batch_invariant import batch_invariant_ops
from swa_bench.kernels.config import KernelSettings
from swa_bench.model.model import Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.results import CheckResult, Diagnostic

# Where a check gets the engine of a configuration. The caller decides reuse, once: the runner
# hands out its cached engines (graphs captured once per configuration, ``CaseRunner.engine``);
# left out, each check builds its own. A check zeroes and refills whatever it is given.
EngineSource = Callable[[EngineConfig], Engine]

_PRECISION_FLAGS = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    # Reduced-precision split-K partial sums in bf16/fp16 GEMMs: a GEMM of 128 rows and one of
    # 16K rows may split K differently, and bf16 partials make that show in the result.
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
)


@contextlib.contextmanager
def check_precision() -> Iterator[None]:
    """TF32 and reduced-precision GEMM reductions off while checking (restored after): the
    checks compare, they do not time, and both paths then accumulate in fp32 alike."""
    saved = [getattr(owner, name) for owner, name in _PRECISION_FLAGS]
    for owner, name in _PRECISION_FLAGS:
        setattr(owner, name, False)
    try:
        yield
    finally:
        for (owner, name), value in zip(_PRECISION_FLAGS, saved, strict=True):
            setattr(owner, name, value)


@contextlib.contextmanager
def check_mode(invariant: bool, device: torch.device) -> Iterator[None]:
    """``check_precision``, and with ``invariant`` the batch-invariant mode
    (``kernels.batch_invariant``): every forward of the check, the engine's, the oracle's and
    the truth's, computes a row with the same bits in any batch."""
    with check_precision():
        if not invariant:
            yield
            return
        with batch_invariant_ops(device):
            yield


def _widened(tol: Tolerance, truth: torch.Tensor, dtype: torch.dtype) -> Tolerance:
    """``tol`` with its atol raised to the rounding envelope of ``truth`` (at least)."""
    return Tolerance(tol.rtol, max(tol.atol, envelope_tolerance(truth, dtype).atol))


def _caches(prefix: str, a: Engine, b: Engine, tol: Tolerance | None,
            envelope: torch.dtype | None = None) -> list[Diagnostic | None]:
    """Every cache tensor of ``a`` against ``b``'s; with ``envelope`` (a dtype), each within
    ``tol`` widened to its own rounding envelope."""
    theirs = b.cache.tensors()
    return [compare(f"{prefix}{n}", t, theirs[n],
                    _widened(tol, theirs[n], envelope) if envelope is not None else tol)
            for n, t in a.cache.tensors().items()]


def _differs(name: str, got, want) -> Diagnostic | None:
    """A structural mismatch (route, kept rows, window starts) as a diagnostic."""
    if got == want:
        return None
    return Diagnostic(tensor=f"{name}: engine {got} != SPEC {want}", mismatched=1, total=1,
                      share=1.0, max_abs=0.0, max_rel=0.0, worst_index=[])


def structure(prefix: str, out: StepOutput, exp: oracle.Expected) -> list[Diagnostic | None]:
    """What the engine kept and where its windows start, against what the SPEC says."""
    diags = [
        _differs(f"{prefix}route.graph_size", out.plan.graph_size, exp.graph_size),
        _differs(f"{prefix}route.replays", out.plan.replays, exp.replays),
        _differs(f"{prefix}route.shape_mode", out.plan.shape_mode, exp.shape_mode),
        _differs(f"{prefix}route.replay_batch_built", out.replay_batch is not None, exp.replays),
        _differs(f"{prefix}route.replay_graph_size", out.plan.replay_graph_size,
                 exp.replay_graph_size),
    ]
    want_lens = exp.kept_lens if exp.replays else tuple(r.query_len for r in out.step.requests)
    diags.append(_differs(f"{prefix}plan.kept_lens", tuple(out.plan.kept_lens), want_lens))
    if out.replay_batch is not None and exp.replays:
        rb = out.replay_batch
        diags.append(_differs(f"{prefix}replay_batch.rows", tuple(rb.rows.tolist()), exp.rows))
        diags.append(_differs(f"{prefix}replay_batch.padded_rows", rb.graph_size,
                              exp.replay_graph_size))
        n = len(exp.kept_starts)
        starts = rb.forward_context.attn_metadata.window_start[:n].tolist()
        diags.append(_differs(f"{prefix}replay_batch.kept_starts", tuple(starts), exp.kept_starts))
        for layer, meta in rb.forward_context.layer_metadata.items():
            got = tuple(meta.window_start[:n].tolist())
            diags.append(_differs(f"{prefix}replay_batch.layer{layer}.window_starts", got,
                                  exp.batch_starts))
    return diags


def _trimmed_zero(prefix: str, out: StepOutput, exp: oracle.Expected) -> list[Diagnostic | None]:
    """Rows the replay trimmed hold zeros (SPEC section 2), not their input streams or
    pre-mix."""
    if not exp.replays:
        return []
    keep = torch.zeros(out.step.num_tokens, dtype=torch.bool)
    keep[list(exp.rows)] = True
    trimmed = (~keep).nonzero().flatten().to(out.streams[0].device)
    return [
        compare(f"{prefix}trimmed_rows.{name}", s.index_select(0, trimmed),
                torch.zeros_like(s.index_select(0, trimmed)), None)
        for name, s in _row_outputs(out)
    ]


def _row_outputs(out) -> list[tuple[str, torch.Tensor]]:
    """A step's per-row outputs by name: the final mHC streams, the final pre-mix the head
    collapses them with (the replay carries both out of the decoder), then DSpark's aux hidden
    states."""
    named = [*((f"stream{i}", s) for i, s in enumerate(out.streams)), ("pre_mix", out.pre_mix)]
    return named + ([] if out.aux_hidden is None else [("aux_hidden", out.aux_hidden)])


def _versus_oracle(prefix: str, out: StepOutput, ora: oracle.OracleOutput, eng: Engine,
                   twin: Engine) -> list[Diagnostic | None]:
    diags = structure(prefix, out, ora.expected)
    diags.append(compare(f"{prefix}logits", out.logits, ora.logits, None))
    diags += [
        compare(f"{prefix}{name}", a, b, None)
        for (name, a), (_, b) in zip(_row_outputs(out), _row_outputs(ora), strict=True)
    ]
    diags += _trimmed_zero(prefix, out, ora.expected)
    diags += _publications(prefix, out, ora)
    diags += _caches(f"{prefix}cache.", eng, twin, None)
    return diags


def _publications(prefix: str, out: StepOutput, ora: oracle.OracleOutput
                  ) -> list[Diagnostic | None]:
    """The kept rows' index selections and S's candidate blocks in the replay batch's context
    against the oracle's, bitwise (S's reach them through the gather of per-row inputs)."""
    if out.replay_batch is None or ora.kept_context is None:
        return []
    mine, theirs = out.replay_batch.forward_context, ora.kept_context
    n = len(ora.expected.rows)
    diags = [compare(f"{prefix}replay_batch.selection.layer{layer}",
                     mine.index_selection[layer][:n], want[:n], None)
             if layer in mine.index_selection else
             _differs(f"{prefix}replay_batch.selection.layer{layer}", "absent", "published")
             for layer, want in sorted(theirs.index_selection.items())]
    if theirs.candidates is not None:
        got = mine.candidates
        diags.append(compare(f"{prefix}replay_batch.candidates", got[:n], theirs.candidates[:n],
                             None) if got is not None else
                     _differs(f"{prefix}replay_batch.candidates", "absent", "published"))
    return diags


def reset(engine: Engine) -> None:
    """Zeros an engine's caches in place (its graphs hold their addresses)."""
    for t in engine.cache._raw():
        t.zero_()


def twin_of(engine: Engine) -> Engine:
    """An eager engine on the same model, kernels and a copy of ``engine``'s caches."""
    twin = Engine(engine.model, EngineConfig.for_model(engine.args, policy="full",
                                                       kernels=engine.config.kernels))
    twin.cache.copy_from(engine.cache)
    return twin


def engines(model: Transformer, inputs: StepInputs, *configs: EngineConfig) -> list[Engine]:
    """Engines with equal caches, each filled with the inputs' context once."""
    first = Engine(model, configs[0])
    inputs.fill_context(first)
    rest = []
    for config in configs[1:]:
        engine = Engine(model, config)
        engine.cache.copy_from(first.cache)
        rest.append(engine)
    return [first, *rest]


def _source(model: Transformer, engines: EngineSource | None) -> EngineSource:
    return engines if engines is not None else lambda config: Engine(model, config)


def prepared(engine: Engine, inputs: StepInputs) -> Engine:
    """``engine`` with its caches zeroed, then filled with the inputs' context."""
    reset(engine)
    inputs.fill_context(engine)
    return engine


@dataclasses.dataclass
class _Checked:
    """One step of the engine under check and the oracle's forward of it from equal caches
    (``twin`` holds the oracle's), graded bitwise in ``diags``."""

    out: StepOutput
    ora: oracle.OracleOutput
    twin: Engine
    diags: list[Diagnostic | None]


def _step_against_oracle(prefix: str, eng: Engine, requests: Sequence[RequestSpec],
                         tokens: Sequence[Sequence[int]], indices) -> _Checked:
    twin = twin_of(eng)
    exp = oracle.expect_for(eng, requests)
    out = eng.step(requests, tokens, indices)
    ora = oracle.oracle_forward(twin, requests, tokens, indices, exp)
    return _Checked(out, ora, twin, _versus_oracle(prefix, out, ora, eng, twin))


def decode(engine: Engine, workload: StepInputs, step: int, tokens: Sequence[int]) -> StepOutput:
    return engine.step(decode_requests(workload.requests, step), [[t] for t in tokens],
                       workload.cache_indices)


def _envelope(prefix: str, pairs, dtype: torch.dtype, allowed: Tolerance | Allowance,
              invariant: bool = False):
    """(diagnostics, worst ratio, max abs) of ``(name, candidate, truth)`` pairs under the
    rounding envelope, or what ``allowed`` sets in its place; bitwise in the batch-invariant
    mode (the ratio is then still reported against the envelope)."""
    diags, ratio, max_abs = [], 0.0, 0.0
    for name, a, b in pairs:
        tol = allowed.over(envelope_tolerance(b, dtype))
        diags.append(compare(f"{prefix}{name}", a, b, None if invariant else tol))
        ratio = max(ratio, envelope_ratio(a, b, tol))
        if a.shape == b.shape and a.numel():
            max_abs = max(max_abs, float((a.double() - b.double()).abs().nan_to_num(
                nan=float("inf")).max()))
    return diags, ratio, max_abs


def _truth(
    pristine: Engine, workload: StepInputs, ora: oracle.OracleOutput, dtype: torch.dtype,
    layer_metadata: dict | None = None, compared: dict[int, list[int]] | None = None,
    invariant: bool = False,
) -> tuple[StepOutput, Engine, SelectionComparison]:
    """The full-batch truth of the oracle's step on a copy of ``pristine``'s caches. For a
    sparse model its top-k selections are judged against the replay's (``checks.selection``);
    where they differ by near-ties it runs again on the replay's selection, so the outputs are
    compared on equal selections. In the batch-invariant mode a selection must be equal: one
    that differs fails, and nothing runs again."""
    reqs, toks, idx = workload.requests, workload.step_tokens, workload.cache_indices
    sparse = ora.kept_context is not None and pristine.args.sparse
    truth = twin_of(pristine)
    ref = truth.reference_step(reqs, toks, idx, layer_metadata=layer_metadata,
                               record_index_queries=sparse)
    chosen = (compare_selections(ora, ref, truth.cache, dtype, compared=compared) if sparse
              else SelectionComparison())
    if chosen.given and invariant:
        chosen.diagnostics.append(Diagnostic(
            tensor=f"top-k selections in the batch-invariant mode ({chosen.rows_differing} of "
                   f"{chosen.rows_compared} (row, index source) pairs differ)",
            mismatched=chosen.rows_differing, total=chosen.rows_compared,
            share=chosen.rows_differing / max(chosen.rows_compared, 1), max_abs=math.inf,
            max_rel=math.inf, worst_index=[]))
        chosen.given = {}
    if chosen.given:
        del ref
        truth = twin_of(pristine)
        ref = truth.reference_step(reqs, toks, idx, layer_metadata=layer_metadata,
                                   given_selection=chosen.given)
    return ref, truth, chosen


def check_e1(
    model: Transformer, workload: StepInputs, config: EngineConfig, *, decode_steps: int,
    tol: Tolerance | Allowance = ENVELOPE, engines: EngineSource | None = None,
    invariant: bool = False,
) -> CheckResult:
    """Replay == the bounded reference, in the case's graph mode.

    Bitwise against the oracle's forward: the route, kept rows and window starts, every row's
    streams (zeros at trimmed rows), the logits and every cache, then ``decode_steps`` decode
    steps. Within the envelope: the oracle's kept rows, logits and caches against the full-batch
    bounded reference (decoder windows cut at the oracle's kept starts), within ``tol``
    (default: the envelope); bitwise in the batch-invariant mode (``invariant``)."""
    config = e1_config(config)
    with check_mode(invariant, model.embed.weight.device):
        eng = prepared(_source(model, engines)(config), workload)
        return check_e1_carried(eng, workload, decode_steps=decode_steps, tol=tol,
                                invariant=invariant)


def e1_config(config: EngineConfig) -> EngineConfig:
    """The configuration E1 checks: the case's, bounded where the case's policy is full (full
    replays nothing, so E1 checks the bounded replay of its mode)."""
    return dataclasses.replace(config, policy="bounded" if config.policy == "full"
                               else config.policy)


def check_e1_carried(
    eng: Engine, workload: StepInputs, *, decode_steps: int,
    tol: Tolerance | Allowance = ENVELOPE, invariant: bool = False,
) -> CheckResult:
    """E1 of ``workload``'s step on ``eng``'s caches as they are (``check_e1`` fills them with
    the context first; a chunked prompt's earlier steps leave them): ``eng`` runs the step, then
    ``decode_steps`` decode steps. The oracle and the bounded reference start from copies of the
    same caches."""
    policy, model = eng.config.policy, eng.model
    dtype = model.embed.weight.dtype
    with check_mode(invariant, model.embed.weight.device):
        pristine = twin_of(eng)
        reqs, toks, idx = workload.requests, workload.step_tokens, workload.cache_indices
        checked = _step_against_oracle("", eng, reqs, toks, idx)
        out, ora, twin, diags = checked.out, checked.ora, checked.twin, checked.diags
        exp = ora.expected
        unpadded = pristine.prepare(reqs, toks, idx)
        ref, truth, chosen = _truth(
            pristine, workload, ora, dtype,
            oracle.bounded_reference_metadata(unpadded, exp, model.args), invariant=invariant,
        )
        del pristine
        diags += chosen.diagnostics
        rows = torch.tensor(exp.kept_rows, dtype=torch.long, device=ref.logits.device)
        # A request that keeps no row (final_window's earlier chunks) samples nothing this step:
        # its logits rows come from zeroed streams by design and are left out of the comparison.
        sampled = [j for j, (r, _) in enumerate(unpadded.logit_rows()) if exp.kept_lens[r] > 0]
        sampled = torch.tensor(sampled, dtype=torch.long, device=ref.logits.device)
        pairs = [("logits", ora.logits.index_select(0, sampled),
                  ref.logits.index_select(0, sampled))]
        pairs += [(f"kept_rows.{name}", a.index_select(0, rows), b.index_select(0, rows))
                  for (name, a), (_, b) in zip(_row_outputs(ora), _row_outputs(ref), strict=True)]
        theirs = truth.cache.tensors()
        pairs += [(f"cache.{n}", t, theirs[n]) for n, t in twin.cache.tensors().items()]
        env, ratio, max_abs = _envelope("reference:", pairs, dtype, tol, invariant)
        del truth, ref
        tokens = _last_tokens(out, out.logits.argmax(-1).tolist())
        for step in range(decode_steps):
            dec = decode_requests(reqs, step)
            d_exp = oracle.expect_for(eng, dec)
            a = eng.step(dec, [[t] for t in tokens], idx)
            b = oracle.oracle_forward(twin, dec, [[t] for t in tokens], idx, d_exp)
            diags += _versus_oracle(f"decode{step}.", a, b, eng, twin) if step in (
                0, decode_steps - 1) else [compare(f"decode{step}.logits", a.logits, b.logits,
                                                   None), *structure(f"decode{step}.", a, d_exp)]
            tokens = b.logits.argmax(-1).tolist()
    note = (f"{policy}, {exp.reason}, {len(exp.kept_rows)} kept rows, {decode_steps} decode "
            f"steps bitwise vs the oracle; bounded reference {_truth_note(invariant)} max abs "
            f"{max_abs:.3g}, {ratio:.3g} of the allowance{chosen.note()}")
    return check_result("E1", f"{policy} replay == bounded reference", diags + env, None, note)


def _truth_note(invariant: bool) -> str:
    """How E1's and E2's full-batch half was judged, for the check's note."""
    return "bitwise (batch-invariant mode)," if invariant else "envelope"


def _last_tokens(out: StepOutput, argmax: list[int]) -> list[int]:
    """One next token per request: the argmax at each request's last logits row."""
    last: dict[int, int] = {}
    for (request, _), token in zip(out.step.logit_rows(), argmax, strict=True):
        last[request] = token
    return [last[i] for i in range(len(out.step.requests))]


def check_e2(
    model: Transformer, workload: StepInputs, config: EngineConfig, *,
    tol: Tolerance | Allowance = ENVELOPE, engines: EngineSource | None = None,
    invariant: bool = False,
) -> CheckResult:
    """Halo replay == the full prefill, in the case's graph mode: bitwise against the oracle's
    halo forward (rows, starts, streams, logits, caches), whose last-token logits and decoder
    rings' last W slots equal the full prefill's within ``tol`` (default: the envelope; bitwise
    in the batch-invariant mode); so do the DSpark draft rings (seeded from target layers'
    inputs at the last W rows, which the halo computes exactly)."""
    config = dataclasses.replace(config, policy="halo")
    dtype = model.embed.weight.dtype
    with check_mode(invariant, model.embed.weight.device):
        eng = prepared(_source(model, engines)(config), workload)
        pristine = twin_of(eng)
        checked = _step_against_oracle("", eng, workload.requests, workload.step_tokens,
                                       workload.cache_indices)
        ora, twin, diags = checked.ora, checked.twin, checked.diags
        exp = ora.expected
        exact = None
        if ora.kept_context is not None:
            exact = {layer: oracle.halo_exact_rows(layer, exp.kept_lens, model.args)
                     for layer in ora.kept_context.index_selection}
        ref, full, chosen = _truth(pristine, workload, ora, dtype, compared=exact,
                                   invariant=invariant)
        del pristine
        diags += chosen.diagnostics
        pairs = [("last_token_logits", _last_rows(ora), _last_rows(ref))]
        args = model.args
        for layer in range(args.last_kv_source + 1, args.n_layers):
            for i, ci in enumerate(workload.indices):
                pairs.append((f"ring.{layer}[request {i}]", twin.cache.ring_window(layer, ci),
                              full.cache.ring_window(layer, ci)))
        for stage in range(args.dspark_layers):
            for i, ci in enumerate(workload.indices):
                pairs.append((f"draft_ring.{stage}[request {i}]",
                              twin.cache.draft_ring_window(stage, ci),
                              full.cache.draft_ring_window(stage, ci)))
        env, ratio, max_abs = _envelope("full_prefill:", pairs, dtype, tol, invariant)
    trimmed = exp.num_tokens - len(exp.kept_rows)
    note = (f"{exp.reason}, {trimmed} rows trimmed, bitwise vs the oracle; full prefill "
            f"{_truth_note(invariant)} max abs {max_abs:.3g}, {ratio:.3g} of the allowance"
            f"{chosen.note()}")
    return check_result("E2", "halo replay == full prefill", diags + env, None, note)


def _last_rows(out: StepOutput) -> torch.Tensor:
    rows = out.step.logit_rows()
    keep = [j for j, (r, _) in enumerate(rows) if j + 1 == len(rows) or rows[j + 1][0] != r]
    return out.logits[keep]


def check_e3(
    model: Transformer, workload: StepInputs, config: EngineConfig, *,
    engines: EngineSource | None = None,
) -> CheckResult:
    """Graph replay == eager at the same padded shape, bitwise: every padded size the workload
    uses is replayed over two row sets (the step, then its requests in reverse order), then
    decode steps, without re-capture; a replay batch in its replay graph against the same
    padded replay batch run eagerly."""
    if config.graph_mode == "eager":
        return CheckResult(id="E3", name="graph replay == eager", passed=True, mode="info",
                           message="eager case: no graph to compare (nothing compared)")
    with check_precision():
        graph = _source(model, engines)(config)
        eager = Engine(model, EngineConfig.for_model(model.args, policy=config.policy,
                                                     halo_align=config.halo_align,
                                                     kernels=config.kernels))
        workload.fill_context(eager)
        graph.cache.copy_from(eager.cache)
        diags, sizes = [], []
        idx = list(workload.indices)
        order = list(range(len(workload.requests)))
        runs = [(workload.requests, workload.step_tokens, idx),
                ([workload.requests[i] for i in order[::-1]],
                 [workload.step_tokens[i] for i in order[::-1]], idx[::-1])]
        tokens = None
        for step in range(2):
            dec = decode_requests(workload.requests, step)
            toks = ([[seq[-1]] for seq in workload.sequences] if tokens is None
                    else [[t] for t in tokens])
            runs.append((dec, toks, idx))
            tokens = [(t[0] * 7 + 3) % model.args.vocab_size for t in toks]
        for n, (requests, toks, indices) in enumerate(runs):
            out = graph.step(requests, toks, indices)
            size = "eager" if out.plan.graph_size is None else str(out.plan.graph_size)
            if out.plan.replay_graph_size is not None:
                size += f" (replay graph {out.plan.replay_graph_size})"
            sizes.append(size)
            ref = graph.eager_equivalent(requests, toks, indices, on=eager)
            diags.append(compare(f"step{n}.logits", out.logits, ref.logits, None))
            diags += [compare(f"step{n}.{name}", a, b, None)
                      for (name, a), (_, b) in zip(_row_outputs(out), _row_outputs(ref),
                                                   strict=True)]
            diags += _caches(f"step{n}.cache.", graph, eager, None)
    note = "padded sizes " + ", ".join(sizes)
    return check_result("E3", f"{config.graph_mode} replay == eager", diags, None, note)


def check_e4(model: Transformer, workload: StepInputs, *, tol: Tolerance,
             kernels: KernelSettings, invariant: bool = False) -> CheckResult:
    """The reference is right: a prefill == the same tokens decoded one by one; chunked prefill
    (chunks below, at and above W) == one prefill, all on ``kernels``. On the workload's longest
    prompt, capped.

    A prefill and a decode are two batch compositions of one function (GEMMs of 49 rows and of
    one need not round alike), so each tensor is judged within ``tol`` widened to the envelope
    E1 and E2 use (``envelope_tolerance``: 256 epsilons of the tensor's RMS): on trained weights
    the logits' scale makes fp32's default atol (1e-5) a few epsilons of it (v41-mini: 30 of
    12544 logits at 2.3e-5). A wrong mask or position moves whole rows by O(RMS). In the
    batch-invariant mode (``invariant``) a row is the same function in any batch, and every
    tensor is compared bitwise."""
    mode = (check_mode(True, model.embed.weight.device) if invariant
            else contextlib.nullcontext())
    with mode:
        return _e4(model, workload, tol, kernels, invariant)


def _e4(model: Transformer, workload: StepInputs, tol: Tolerance, kernels: KernelSettings,
        invariant: bool) -> CheckResult:
    w = model.args.window
    dtype = next(model.parameters()).dtype

    def judged(t: torch.Tensor) -> Tolerance | None:  # None: bitwise
        return None if invariant else _widened(tol, t, dtype)

    length = min(max(r.prompt_len for r in workload.requests), 3 * w + 1)
    seq = list(
        StepInputs.seeded([RequestSpec(prompt_len=length)], model.args.vocab_size, 7).sequences[0]
    )
    reference = EngineConfig.for_model(model.args, policy="full", kernels=kernels)
    whole = Engine(model, reference)
    prefill = whole.reference_step(
        [RequestSpec(prompt_len=length, prompt_logprobs=True)], [seq], [0]
    )
    decode = Engine(model, reference)
    rows = []
    for pos in range(length):
        req = RequestSpec(prompt_len=pos, decode=True) if pos else RequestSpec(prompt_len=1)
        rows.append(decode.reference_step([req], [[seq[pos]]], [0]).logits)
    decoded = torch.cat(rows)
    cache_tol, envelope = (None, None) if invariant else (tol, dtype)
    diags = [compare("prefill_vs_decode.logits", prefill.logits, decoded, judged(decoded))]
    diags += _caches("prefill_vs_decode.cache.", whole, decode, cache_tol, envelope)
    for chunk in sorted({max(1, w - 1), w, w + 1}):
        chunked = Engine(model, reference)
        rows = []
        for start in range(0, length, chunk):
            req = RequestSpec(
                prompt_len=length, cached_len=start, chunk_size=chunk, prompt_logprobs=True
            )
            rows.append(
                chunked.reference_step([req], [seq[start : start + req.query_len]], [0]).logits
            )
        diags.append(compare(f"chunk{chunk}.logits", torch.cat(rows), prefill.logits,
                             judged(prefill.logits)))
        diags += _caches(f"chunk{chunk}.cache.", chunked, whole, cache_tol, envelope)
    note = f"prompt of {length}" + (", bitwise (batch-invariant mode)" if invariant else "")
    return check_result(
        "E4",
        "reference == token-by-token decode, chunked == one prefill",
        diags,
        None if invariant else tol,
        note,
    )


def check_e5(
    model: Transformer, workload: StepInputs, config: EngineConfig, *,
    engines: EngineSource | None = None,
) -> CheckResult:
    """Steps with nothing to trim take the route the SPEC gives them and equal the whole-batch
    reference at the same padded shape, bitwise, in the case's graph mode: a step of every
    request's first min(prompt, W) tokens as a cold prefill (decode rows stay), then the decode
    step after the workload."""
    w = model.args.window
    short = [r if r.decode else RequestSpec(prompt_len=min(r.prompt_len, w))
             for r in workload.requests]
    small = StepInputs(tuple(short), tuple(seq[: r.seq_len] for r, seq in
                                           zip(short, workload.sequences, strict=True)),
                       workload.cache_indices)
    diags: list[Diagnostic | None] = []
    routes = []
    source = _source(model, engines)
    with check_precision():
        for name, inputs, requests, tokens in (
            ("short_prefills.", small, small.requests, small.step_tokens),
            ("decode.", workload, decode_requests(workload.requests, 0),
             [[seq[-1]] for seq in workload.sequences]),
        ):
            eng = prepared(source(config), inputs)
            if name == "decode.":
                eng.reference_step(inputs.requests, inputs.step_tokens, inputs.cache_indices)
            checked = _step_against_oracle(name, eng, requests, tokens, inputs.cache_indices)
            exp = checked.ora.expected
            diags += checked.diags
            diags.append(_differs(f"{name}trims", exp.trims, False))
            routes.append(exp.reason)
    return check_result("E5", "nothing to trim == reference", diags, None,
                        "short prefills: " + routes[0] + "; decode: " + routes[1])
