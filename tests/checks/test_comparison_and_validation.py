"""NaN and Inf fail every comparison; validation reserves the checks' decode positions and
checks explicit cache indices."""

from __future__ import annotations

import math

import torch

from swa_bench.checks.comparison import Tolerance, compare, envelope_ratio, envelope_tolerance
from swa_bench.checks.tolerance import ENVELOPE, Allowance
from swa_bench.scenario import scenario_from_text

TOL = Tolerance(1.3e-6, 1e-5)


def test_nan_and_inf_are_mismatches():
    nan = torch.tensor([1.0, math.nan])
    assert compare("t", nan, nan.clone(), TOL) is not None
    assert compare("t", nan, nan.clone(), None) is not None
    inf = torch.tensor([math.inf, 1.0])
    assert compare("t", inf, inf.clone(), TOL) is not None
    assert compare("t", torch.ones(3), torch.ones(3), TOL) is None


def test_envelope_scales_with_the_tensor():
    truth = torch.full((10,), 10.0)
    tol = envelope_tolerance(truth, torch.float32)
    assert tol.atol > 1e-5 and tol.rtol == 1.3e-6
    assert envelope_ratio(truth + tol.atol / 2, truth, tol) < 1
    assert compare("t", truth + 1.0, truth, tol) is not None  # an O(1) error is no rounding


def test_one_tolerance_argument_sets_all_some_or_none_of_the_envelope():
    """E1/E2 take one ``tol``: a Tolerance replaces the envelope, an Allowance replaces only the
    rtol or atol a scenario sets, ``ENVELOPE`` is the envelope itself."""
    envelope = envelope_tolerance(torch.full((10,), 10.0), torch.float32)
    assert ENVELOPE.over(envelope) == envelope
    assert TOL.over(envelope) == TOL
    assert Allowance(rtol=0.5).over(envelope) == Tolerance(0.5, envelope.atol)
    assert Allowance(atol=0.25).over(envelope) == Tolerance(envelope.rtol, 0.25)
    assert Allowance(0.5, 0.25).over(envelope) == Tolerance(0.5, 0.25)


def test_unwritten_cache_slots_do_not_shrink_the_envelope():
    """One slot of eight written (a 16K run on v41-flash's ring): the allowance is that of the
    written rows, as if the cache held that slot alone."""
    written = torch.randn(128, 64, generator=torch.Generator().manual_seed(0))
    cache = torch.zeros(8 * 128, 64)
    cache[3 * 128 : 4 * 128] = written
    assert envelope_tolerance(cache, torch.bfloat16) == envelope_tolerance(written, torch.bfloat16)


def problems(extra: str) -> list[str]:
    text = f"name: t\nmodel: {{preset: tiny}}\n{extra}"
    return [".".join(map(str, loc)) + ": " + msg for loc, msg in
            scenario_from_text(text).problems()]


def test_decode_positions_are_reserved():
    # tiny: max_seq_len 256, W 8: E1 decodes 2W = 16 tokens after the step
    out = problems("workload: {requests: [{prompt_len: 250}]}\n")
    assert any(p.startswith("workload.requests.0.prompt_len") and "16 more" in p for p in out)
    assert problems("workload: {requests: [{prompt_len: 240}]}\n") == []
    off = "checks: {e1: {enabled: false}}\nworkload: {requests: [{prompt_len: 250}]}\n"
    assert problems(off) == []


def test_explicit_cache_order_is_checked():
    bad = "workload: {requests: [{prompt_len: 9, repeat: 2}], cache_order: [3, 3]}\n"
    assert any(p.startswith("workload.cache_order") for p in problems(bad))
    good = "workload: {requests: [{prompt_len: 9, repeat: 2}], cache_order: [5, 2]}\n"
    assert problems(good) == []


def test_info_is_not_a_pass():
    from tests.report.synthetic import synthetic_run

    run = synthetic_run(failing=False, error=False)
    for case in run.cases:
        case.checks = [c.model_copy(update={"mode": "info"}) for c in case.checks]
    counts = run.counts()
    assert counts["checks_passed"] == 0 and counts["checks_info"] == counts["checks"]
    assert run.verdict() == "unverified"  # nothing was compared


def test_check_precision_turns_reduced_precision_off_and_restores_it():
    import torch

    from swa_bench.checks.equivalence import check_precision

    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = True
    try:
        with check_precision():
            assert not matmul.allow_tf32 and not matmul.allow_bf16_reduced_precision_reduction
            assert not matmul.allow_fp16_reduced_precision_reduction
        assert matmul.allow_bf16_reduced_precision_reduction
    finally:
        matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = before
