"""Comparing tensors: bitwise (integer views, so NaN and -0.0 count) or within a tolerance.

A mismatch is reported with what a user needs to judge it (SPEC section 3): the tensor, how many
elements differ and their share, max abs and rel error, the index of the worst element.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from swa_bench.checks.tolerance import DEFAULT_TOLERANCES, Tolerance
from swa_bench.results import CheckResult, Diagnostic

__all__ = ["DEFAULT_TOLERANCES", "Tolerance", "check_result", "compare"]

def _int_view(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def compare(
    name: str, actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance | None
) -> Diagnostic | None:
    """None when equal (bitwise if ``tol`` is None); else what differs and where.

    A NaN or an infinity in either tensor is a mismatch in both modes: no path may produce one,
    and NaN == NaN would hide a broken kernel on both sides."""
    if actual.shape != expected.shape:
        return Diagnostic(
            tensor=f"{name} (shape {tuple(actual.shape)} != {tuple(expected.shape)})",
            mismatched=max(actual.numel(), expected.numel()),
            total=expected.numel(),
            share=1.0,
            max_abs=math.inf,
            max_rel=math.inf,
            worst_index=[],
        )
    a, e = actual.detach(), expected.detach()  # on their device: caches hold GiBs at 64K
    if tol is None:
        mismatch = _int_view(a) != _int_view(e)
    else:
        af, ef = a.double(), e.double()
        close = (af - ef).abs() <= tol.atol + tol.rtol * ef.abs()
        mismatch = ~close
    mismatch = mismatch | ~a.isfinite() | ~e.isfinite()
    count = int(mismatch.sum())
    if count == 0:
        return None
    diff = (a.double() - e.double()).abs().nan_to_num(nan=math.inf)
    rel = diff / e.double().abs().clamp_min(1e-30)
    worst = int(torch.where(mismatch, diff, torch.full_like(diff, -1.0)).flatten().argmax())
    return Diagnostic(
        tensor=name,
        mismatched=count,
        total=mismatch.numel(),
        share=count / mismatch.numel(),
        max_abs=float(diff[mismatch].max()),
        max_rel=float(rel[mismatch].max()),
        worst_index=[int(i) for i in torch.unravel_index(torch.tensor(worst), mismatch.shape)],
    )


ENVELOPE_ULPS = 256


def envelope_tolerance(truth: torch.Tensor, dtype: torch.dtype) -> Tolerance:
    """The allowance for two batch compositions of one function (GEMMs of 128 and of 16K rows
    need not round alike, and the difference compounds over layers): the dtype's default rtol,
    and an atol of ``ENVELOPE_ULPS`` machine epsilons of the tensor's RMS, since an element near
    zero carries the absolute error of its whole row. The RMS is that of the nonzero elements: a
    cache's unwritten slots hold zeros, and a run that fills one slot of eight must not get an
    allowance shrunk by sqrt(8). Wide enough for rounding at 16K-64K tokens, far below what a
    wrong mask or row does (those are judged bitwise against the oracle)."""
    base = Tolerance.for_dtype(dtype)
    t = truth.detach().double()
    finite = t[t.isfinite() & (t != 0)]
    rms = float(finite.pow(2).mean().sqrt()) if finite.numel() else 0.0
    return Tolerance(base.rtol, max(base.atol, ENVELOPE_ULPS * torch.finfo(dtype).eps * rms))


def envelope_ratio(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance) -> float:
    """max |a - b| / (atol + rtol |b|): below 1 within the allowance."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape:
        return math.inf
    ratio = ((a - e).abs() / (tol.atol + tol.rtol * e.abs())).nan_to_num(nan=math.inf)
    return float(ratio.max()) if ratio.numel() else 0.0


def check_result(
    check_id: str,
    name: str,
    diagnostics: Iterable[Diagnostic | None],
    tol: Tolerance | None,
    note: str = "",
    *,
    enveloped: bool = False,
) -> CheckResult:
    """One check's result from its diagnostics: bitwise where ``tol`` is None, unless the
    tensors were judged each against its own allowance (``enveloped``: the rounding envelope or
    a scenario's rtol/atol per tensor, so no one tolerance is recorded)."""
    found = [d for d in diagnostics if d is not None]
    mode = "bitwise" if tol is None and not enveloped else "tolerance"
    if found:
        worst = max(found, key=lambda d: (d.share, d.max_abs))
        message = (
            f"{len(found)} tensor(s) differ; worst {worst.tensor}: "
            f"{worst.mismatched}/{worst.total} elements, max abs {worst.max_abs:.3g}, "
            f"max rel {worst.max_rel:.3g} at {worst.worst_index}"
        )
    else:
        message = "equal (each tensor within its allowance)" if enveloped else f"equal ({mode})"
    if note:
        message = f"{message}; {note}"
    return CheckResult(
        id=check_id,
        name=name,
        passed=not found,
        mode=mode,
        rtol=None if tol is None else tol.rtol,
        atol=None if tol is None else tol.atol,
        message=message,
        diagnostics=found,
    )
