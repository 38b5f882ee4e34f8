"""mHC: the residual carried as ``hc_mult`` streams, mixed into each sublayer's input and
written back after it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from swa_bench.kernels import (
    fused_hc,
    hc_gains,
    hc_gated_pre,
    hc_post,
    hc_post_gated_pre,
    hc_pre,
    hc_pre_folds_norm,
)
from swa_bench.model.args import ModelArgs
from swa_bench.model.derived import derived_from_weights
from swa_bench.model.forward_context import active_kernels
from swa_bench.model.norm import RMSNorm

Streams = tuple[torch.Tensor, ...]

HC_ROWS = 8192


class HyperConnection(nn.Module):
    """mHC around one sublayer: mixes the streams into its input and writes its output back.

    ``pre`` takes a per-row weighted sum of the streams (dynamic weights from the normed streams);
    ``post`` mixes the streams with a doubly-stochastic matrix and adds the sublayer output with
    per-row, per-stream gains. ``hc_mult == 1`` is a plain pre-norm residual.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hc, self.hc = args.hc_mult, args.hc_mult
        if hc > 1:
            self.norm = RMSNorm(hc * args.dim, args.norm_eps)
            self.dynamic = nn.Linear(hc * args.dim, 2 * hc, bias=False)
            self.static_pre = nn.Parameter(torch.zeros(hc))
            self.static_post = nn.Parameter(torch.zeros(hc))
            self.res_logits = nn.Parameter(torch.zeros(hc, hc))

    def gains(self, streams: Streams) -> torch.Tensor:
        """The dynamic gains ``[T, 2 hc]`` by row chunks: the normed concatenation is ``hc``
        times a stream's size (5 GiB per 64K rows at V4.1-Flash's width)."""
        rows = streams[0].shape[0]
        if rows <= HC_ROWS:
            return self.dynamic(self.norm(torch.cat(streams, dim=-1))).float()
        return torch.cat([
            self.dynamic(self.norm(torch.cat([s[r : r + HC_ROWS] for s in streams], dim=-1)))
            for r in range(0, rows, HC_ROWS)
        ]).float()

    def pre(self, streams: Streams, norm: RMSNorm | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sublayer's input, normed by ``norm`` when given, and the ``post`` gains."""
        if self.hc == 1:
            return (streams[0] if norm is None else norm(streams[0])), None
        kernels = active_kernels()
        if fused_hc(kernels, streams):
            statics = (self.static_pre, self.static_post)
            if hc_pre_folds_norm(streams[0].shape[1]):  # narrow rows: gates, sum, norm at once
                return hc_gated_pre(kernels, streams, self.norm.weight, self.dynamic.weight,
                                    self.norm.eps, statics,
                                    None if norm is None else (norm.weight, norm.eps))
            gates = hc_gains(kernels, streams, self.norm.weight, self.dynamic.weight,
                             self.norm.eps, statics)  # the gates in one kernel, the sum in another
            x = hc_pre(kernels, streams, gates[:, : self.hc])
            return (x if norm is None else norm(x)), gates[:, self.hc :]
        gains = self.gains(streams)
        pre = torch.sigmoid(gains[:, : self.hc] + self.static_pre)
        post = 2 * torch.sigmoid(gains[:, self.hc :] + self.static_post)
        x = weighted_sum(streams, [pre[:, j : j + 1] for j in range(self.hc)])
        return (x if norm is None else norm(x)), post

    def post_then_pre(self, streams: Streams, out: torch.Tensor, post: torch.Tensor | None,
                      nxt: HyperConnection, norm: RMSNorm
                      ) -> tuple[Streams, torch.Tensor, torch.Tensor | None]:
        """``post`` of this sublayer, then ``nxt.pre(new streams, norm)``: the new streams, the
        next sublayer's input and its post gains. One launch instead of three where the fused
        kernels take the streams and a program holds a row (``hc_pre_folds_norm``)."""
        kernels = active_kernels()
        if (self.hc > 1 and hc_pre_folds_norm(streams[0].shape[1])
                and fused_hc(kernels, streams, out)):
            return hc_post_gated_pre(
                kernels, streams, out, post, self.mixing(), nxt.norm.weight, nxt.dynamic.weight,
                nxt.norm.eps, (nxt.static_pre, nxt.static_post), (norm.weight, norm.eps))
        streams = self.post(streams, out, post)
        return (streams, *nxt.pre(streams, norm))

    def post(self, streams: Streams, out: torch.Tensor, post: torch.Tensor | None) -> Streams:
        if self.hc == 1:
            return (streams[0] + out,)
        mix = self.mixing()
        kernels = active_kernels()
        if fused_hc(kernels, streams, out):
            return hc_post(kernels, streams, out, post, mix)
        return tuple(
            weighted_sum((out, *streams), [post[:, i : i + 1], *mix[i]]) for i in range(self.hc)
        )

    def mixing(self) -> torch.Tensor:
        """``sinkhorn(res_logits)``, a function of the weights alone: computed once, again only
        when ``res_logits`` changes (its version counter), not by every forward. A forward that
        trains ``res_logits`` always computes it (it needs the gradient, and a captured training
        step must hold the computation, not a constant)."""
        logits = self.res_logits
        if logits.requires_grad and torch.is_grad_enabled():
            return sinkhorn(logits.float())
        return derived_from_weights(self, "_mixing", (logits,), lambda: sinkhorn(logits.float()))


def weighted_sum(terms: Sequence[torch.Tensor], gains: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j gains[j] * terms[j]`` accumulated in fp32 (gains fp32, per row ``[T, 1]`` or 0-dim)
    and rounded once to the terms' dtype. Mixed-dtype kernels read the bf16 terms directly: no
    fp32 copy of a stream is ever materialised."""
    acc = terms[0] * gains[0]
    for term, gain in zip(terms[1:], gains[1:], strict=True):
        acc.addcmul_(term, gain)
    return acc.to(terms[0].dtype)


def sinkhorn(logits: torch.Tensor, iters: int = 8) -> torch.Tensor:
    """A doubly-stochastic matrix from logits: residual mixing keeps the streams' total mass."""
    m = logits.exp()
    for _ in range(iters):
        m = m / m.sum(dim=1, keepdim=True)
        m = m / m.sum(dim=0, keepdim=True)
    return m
