"""Breakable capture's eager breaks: a ``writes_out`` break writes into its fixed buffer at
replay (no fresh output, no copy), a plain one is copied in; both replay the eager values."""

from __future__ import annotations

import pytest
import torch

from swa_bench.graphs.breakable import BreakBuffers, SegmentedCapture
from swa_bench.graphs.standin import TapeSegment
from swa_bench.model.graph_breaks import eager_break

CALLS: list[torch.Tensor | None] = []  # the ``out`` each call of ``scaled`` was given


@eager_break("test_scaled", writes_out=True)
def scaled(x: torch.Tensor, factor: torch.Tensor, *, out: torch.Tensor | None = None):
    CALLS.append(out)
    return torch.mul(x, factor, out=x.new_empty(x.shape) if out is None else out)


@eager_break("test_plain")
def plain(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return x * factor


@eager_break("test_liar", writes_out=True)
def liar(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    return x + 1  # ignores ``out``


def _captured(fn, x: torch.Tensor, factor: torch.Tensor):
    capture = SegmentedCapture(TapeSegment, BreakBuffers(), breaks=True)
    out = capture.capture(lambda: fn(x + 1, factor) * 2)
    return capture, out


@pytest.mark.parametrize("fn", [scaled, plain])
def test_a_break_replays_the_eager_value_under_new_inputs(fn):
    x, factor = torch.randn(5, 3), torch.tensor(3.0)
    capture, out = _captured(fn, x, factor)
    for _ in range(2):
        x.copy_(torch.randn(5, 3))
        factor.fill_(float(torch.randint(1, 9, ())))
        CALLS.clear()
        assert capture.run() is out
        assert torch.equal(out, fn(x + 1, factor) * 2)


def test_writes_out_hands_the_break_its_buffer_at_replay():
    x, factor = torch.randn(4, 2), torch.tensor(2.0)
    capture, _ = _captured(scaled, x, factor)
    (brk,) = [p for p in capture.pieces if hasattr(p, "writes_out")]
    assert brk.writes_out
    CALLS.clear()
    capture.run()
    assert len(CALLS) == 1 and CALLS[0] is brk.outputs[0]  # written in place: nothing to copy


def test_a_writes_out_break_that_ignores_out_is_refused_at_replay():
    x = torch.randn(3, 2)
    capture = SegmentedCapture(TapeSegment, BreakBuffers(), breaks=True)
    capture.capture(lambda: liar(x) * 2)
    with pytest.raises(RuntimeError, match="returned other tensors"):
        capture.run()
