"""mHC: the residual carried as ``hc_mult`` streams (DeepSeek-V4.1 inference/model.py
`Block.hc_mixes`, `Block.hc_pre`, `Block.hc_post`; kernel_cpu.py `hc_split_sinkhorn`).

Each sublayer derives three coefficient sets from the streams it receives: ``pre`` (how to
collapse streams into a sublayer input), ``post`` (how much of the sublayer output each stream
takes) and ``comb`` (a per-row doubly-stochastic mixing of the residual streams). The pre of a
sublayer is used by the *next* one (the delayed pre-mix): attention collapses with the previous
block's FFN pre, the FFN with this block's attention pre, the head with the last FFN's.

Pure functions of (streams, coefficients, weights); the model owns the weights under the
reference's names (``hc_attn_fn``, ``hc_attn_base``, ``hc_attn_scale``, ``hc_ffn_*``).
``hc_mult == 1`` is a plain pre-norm residual: pre all ones, ``stream + out``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swa_bench.kernels import fused_hc, hc_post, hc_pre, hc_project, hc_split_sinkhorn
from swa_bench.model.args import ModelArgs
from swa_bench.model.forward_context import active_kernels

Streams = tuple[torch.Tensor, ...]

HC_ROWS = 8192  # rows a projection chunk flattens: hc * dim fp32 values a row


@dataclass(frozen=True)
class Mixes:
    """One sublayer's coefficients of every row, fp32: ``pre [T, hc]``, ``post [T, hc]``,
    ``comb [T, hc, hc]`` (``comb[r, j, i]``: stream ``j``'s share of new stream ``i``)."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


@dataclass(frozen=True)
class HyperConnection:
    """The mHC constants of a model; the weights are passed in (the block owns them)."""

    hc: int
    sinkhorn_iters: int
    eps: float  # hc_eps: added to pre and inside Sinkhorn
    norm_eps: float  # of the one rsqrt statistic over the flattened streams

    @classmethod
    def from_args(cls, args: ModelArgs) -> HyperConnection:
        return cls(args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)

    def identity_pre_mix(self, like: torch.Tensor) -> torch.Tensor:
        """The first block's attention pre-mix (`make_identity_pre_mix`): one-hot on stream 0,
        ``[T, hc]`` fp32; all ones for one stream (the plain residual)."""
        pre_mix = like.new_zeros(like.shape[0], self.hc, dtype=torch.float32)
        pre_mix[:, 0] = 1.0
        return pre_mix

    def mixes(self, streams: Streams, fn: torch.Tensor, scale: torch.Tensor,
              base: torch.Tensor) -> Mixes:
        """`hc_mixes`: the flattened streams (fp32) projected by ``fn [(2+hc) hc, hc dim]``,
        times one ``rsqrt(mean square + norm_eps)`` per row (no norm weight), then split."""
        kernels = active_kernels()
        if fused_hc(kernels, streams) and kernels.inference(fn, scale, base):
            raw = hc_project(kernels, streams, fn, self.norm_eps)
            pre, post, comb = hc_split_sinkhorn(kernels, raw, scale, base, self.hc,
                                                self.sinkhorn_iters, self.eps)
        else:
            raw = project(streams, fn, self.norm_eps)
            pre, post, comb = split_sinkhorn(raw, scale, base, self.hc, self.sinkhorn_iters,
                                             self.eps)
        return Mixes(pre, post, comb)

    def pre(self, streams: Streams, pre_mix: torch.Tensor) -> torch.Tensor:
        """`hc_pre`: ``sum_j pre_mix[:, j] * stream_j`` in fp32, rounded to the streams' dtype."""
        if self.hc == 1:
            return streams[0]
        kernels = active_kernels()
        if fused_hc(kernels, streams):
            return hc_pre(kernels, streams, pre_mix)
        return weighted_sum(streams, [pre_mix[:, j : j + 1] for j in range(self.hc)])

    def post(self, out: torch.Tensor, streams: Streams, mixes: Mixes | None) -> Streams:
        """`hc_post`: new stream ``i = post[:, i] * out + sum_j comb[:, j, i] * stream_j`` (fp32
        sums, rounded once)."""
        if self.hc == 1:
            return (streams[0] + out,)
        kernels = active_kernels()
        if fused_hc(kernels, streams, out):
            return hc_post(kernels, streams, out, mixes.post, mixes.comb)
        return tuple(
            weighted_sum((out, *streams),
                         [mixes.post[:, i : i + 1],
                          *(mixes.comb[:, j, i : i + 1] for j in range(self.hc))])
            for i in range(self.hc))


def project(streams: Streams, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``F.linear(flat, fn) * rsqrt(mean(flat^2) + norm_eps)`` with ``flat`` the fp32
    concatenation of the streams, by row chunks: ``flat`` is ``hc`` times a stream's size, in
    fp32 (a 64K-row V4.1-Flash prefill would hold 4 GiB at once)."""
    rows = streams[0].shape[0]
    chunks = []
    for r in range(0, max(rows, 1), HC_ROWS):
        flat = torch.cat([s[r : r + HC_ROWS] for s in streams], dim=-1).float()
        rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        chunks.append(F.linear(flat, fn.float()) * rsqrt)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                   iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernel_cpu.py `hc_split_sinkhorn`: ``pre = sigmoid + eps``, ``post = 2 sigmoid``, ``comb``
    a row softmax plus ``eps``, column-normalised, then ``iters - 1`` times row- then
    column-normalised, ``eps`` added to every sum. The PyTorch path and the kernels' oracle."""
    mixes, scale, base = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]
    comb = logits.unflatten(-1, (hc, hc)).softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def weighted_sum(terms: Sequence[torch.Tensor], gains: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j gains[j] * terms[j]`` accumulated in fp32 (gains fp32, per row ``[T, 1]``) and
    rounded once to the terms' dtype. Mixed-dtype kernels read the bf16 terms directly: no fp32
    copy of a stream is ever materialised."""
    acc = terms[0] * gains[0]
    for term, gain in zip(terms[1:], gains[1:], strict=True):
        acc.addcmul_(term, gain)
    return acc.to(terms[0].dtype)


def add_mix_parameters(block: nn.Module, args: ModelArgs) -> None:
    """A block's mHC weights under the reference's names (``Block.__init__``), fp32 whatever the
    model dtype: ``hc_{attn,ffn}_fn [(2+hc) hc, hc dim]``, ``_base [(2+hc) hc]``, ``_scale [3]``;
    none for one stream (the plain residual)."""
    if args.hc_mult == 1:
        return
    mix_hc, hc_dim = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
    for part in ("attn", "ffn"):
        block.register_parameter(f"hc_{part}_fn", nn.Parameter(
            torch.empty(mix_hc, hc_dim, dtype=torch.float32)))
        block.register_parameter(f"hc_{part}_base", nn.Parameter(
            torch.empty(mix_hc, dtype=torch.float32)))
        block.register_parameter(f"hc_{part}_scale", nn.Parameter(
            torch.empty(3, dtype=torch.float32)))
