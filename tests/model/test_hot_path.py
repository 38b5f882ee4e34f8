"""The hot path's rewritten pieces against direct restatements (RoPE's: tests/model/test_rope.py):
the mHC weighted sums, the grouped GEMM's dense fallback."""

import pytest
import torch

import swa_bench.model.moe as model_module
from swa_bench.model.hyper_connection import weighted_sum


def _once_rounded_error(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor):
    """Each element's error over what one rounding to bf16 allows: half a bf16 ulp of the result,
    plus the fp32 accumulation's few ulps of the terms' magnitude. Above 1: rounded twice."""
    ulp = torch.exp2(torch.floor(torch.log2(torch.maximum(got.double().abs(), exact.abs())
                                            .clamp_min(1e-30))) - 7)
    allowed = ulp / 2 + 8 * 2.0**-24 * magnitude
    return ((got.double() - exact).abs() / allowed).max().item()


def test_weighted_sum_accumulates_in_fp32_and_rounds_once():
    torch.manual_seed(1)
    terms = [torch.randn(16, 64).bfloat16() for _ in range(4)]
    gains = [torch.rand(16, 1), torch.tensor(0.3), torch.rand(16, 1), torch.tensor(-1.7)]
    got = weighted_sum(terms, gains)
    assert got.dtype == torch.bfloat16
    pairs = list(zip(gains, terms, strict=True))
    exact = sum(g.double() * t.double() for g, t in pairs)
    magnitude = sum((g.double() * t.double()).abs() for g, t in pairs)
    assert _once_rounded_error(got, exact, magnitude) <= 1
    rounded_each_step = terms[0] * gains[0].bfloat16()
    for g, t in pairs[1:]:
        rounded_each_step = rounded_each_step + t * g.bfloat16()
    assert _once_rounded_error(rounded_each_step, exact, magnitude) > 1, "the bound sees it"


@pytest.mark.parametrize("counts", [[3, 0, 5, 1, 0, 0, 7, 2], [0, 0, 0], [2, 2, 2, 1]])
@pytest.mark.parametrize("chunk", [1 << 28, 300, 1])
def test_dense_grouped_gemm_is_each_row_times_its_groups_weights(monkeypatch, counts, chunk):
    """Empty groups, rows past the last group (zeros); every group in one chunk, a few groups a
    chunk (``300 // (rows x 5)``: three for the first counts), one a chunk."""
    monkeypatch.setattr(model_module, "GROUPED_FALLBACK_ELEMENTS", chunk)
    gen = torch.Generator().manual_seed(len(counts))
    rows = sum(counts) + 2
    x = torch.randn(rows, 6, dtype=torch.float64, generator=gen)
    w = torch.randn(len(counts), 5, 6, dtype=torch.float64, generator=gen)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    want = torch.zeros(rows, 5, dtype=torch.float64)
    start = 0
    for g, c in enumerate(counts):
        for r in range(start, start + c):
            want[r] = w[g] @ x[r]
        start += c
    torch.testing.assert_close(model_module.grouped_mm_dense(x, w, ends), want)
