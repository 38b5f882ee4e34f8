"""mHC in one pass each (Triton), for up to four streams: ``hc_project`` (the mixes: the
flattened streams' projection and rsqrt statistic), ``hc_split_sinkhorn`` (a row's pre, post and
Sinkhorn-normalised comb from its mixes), ``hc_pre`` (the weighted sum of the
streams) and ``hc_post`` (the sublayer output and the comb-mixed residual into new streams).

The model calls them when its ``Kernels`` are Triton's and no gradient is wanted (they have no
backward: training uses the PyTorch path); ``model.hyper_connection`` keeps the PyTorch
restatement, the CPU path and these kernels' oracle. Each row's result depends on that row
alone, so they are batch-invariant, and a replayed CUDA graph runs them as eager steps
do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels.config import Kernels, call_op, next_pow2
from swa_bench.kernels.launch import launch

MAX_STREAMS = 4
BLOCK_D = 1024
SINKHORN_BLOCK_R = 32  # rows a Sinkhorn program owns: 32 x 4 x 4 fp32 in registers
# Rows a projection program owns and columns a step, by the streams' dtype (never the batch's
# shape: a row's sums keep one order). bf16 streams run tensor-core dots (``_split_dot``), whose
# Hopper instructions take 64 rows; fp32 streams a full-precision fp32 dot.
PROJECT_TILE = {torch.bfloat16: (64, 64), torch.float32: (32, 128)}


def fused_hc(kernels: Kernels, streams: Sequence[torch.Tensor],
             out: torch.Tensor | None = None) -> bool:
    """Whether these streams' sums (and a ``post``'s sublayer ``out``) run here: the Triton
    backend is bound (``kernels``), no gradient is wanted, and the kernels take them (at
    most four 2-D streams; every tensor with unit column stride, one row stride, one dtype)."""
    first = streams[0]
    every = (*streams, out) if out is not None else tuple(streams)
    if len(streams) > MAX_STREAMS or not kernels.inference(*every):
        return False
    return first.dim() == 2 and first.stride(1) == 1 and all(
        t.stride() == first.stride() and t.dtype == first.dtype for t in every)


def _grid(rows: int, dim: int) -> tuple[int, int]:
    return rows, -(-dim // BLOCK_D)


def _padded(streams: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return list(streams) + [streams[0]] * (MAX_STREAMS - len(streams))


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous fp32, copied only where it is not already."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def _hc_project(streams: list[torch.Tensor], fn: torch.Tensor, eps: float,
                direct: bool, interpret: bool) -> torch.Tensor:
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    split = streams[0].dtype == torch.bfloat16
    block_r, block_d = PROJECT_TILE[torch.bfloat16 if split else torch.float32]
    mixes = torch.empty(rows, fn.shape[0], dtype=torch.float32, device=streams[0].device)
    if rows == 0:
        return mixes
    s = _padded(streams)
    launch(triton_hc.hc_project_kernel, (-(-rows // block_r),),
        *s, fn, mixes, rows, s[0].stride(0), fn.stride(0), mixes.stride(0), eps, D=dim,
        HC=len(streams), OUT=fn.shape[0], OUT_PAD=max(16, next_pow2(fn.shape[0])),
        BLOCK_R=block_r, BLOCK_D=block_d, SPLIT=split, INTERPRET=interpret, direct=direct,
        num_warps=4, num_stages=2)
    return mixes


hc_project_op = torch.library.custom_op("swa_bench::hc_project", _hc_project, mutates_args=())


@hc_project_op.register_fake
def _(streams, fn, eps, direct, interpret):
    return streams[0].new_empty(streams[0].shape[0], fn.shape[0], dtype=torch.float32)


@register_flop_formula(torch.ops.swa_bench.hc_project)
def _hc_project_flop_formula(stream_shapes, fn_shape, *args, out_shape=None, **kwargs) -> int:
    """The GEMM the PyTorch path runs: ``[T, hc dim] x [hc dim, n]``."""
    return 2 * stream_shapes[0][0] * fn_shape[1] * fn_shape[0]


def hc_project(kernels: Kernels, streams: Sequence[torch.Tensor], fn: torch.Tensor,
               eps: float) -> torch.Tensor:
    """``F.linear(flat, fn) * rsqrt(mean(flat^2) + eps)`` as fp32 ``[T, fn rows]``, ``flat`` the
    fp32 concatenation of the streams (``model.hyper_connection.project``), without the
    concatenation or its fp32 copy (each ``hc`` times a stream's size): one read of the
    streams. A custom op with a FLOP formula: torch's counter sees the GEMM it replaces."""
    if fn.shape[1] != len(streams) * streams[0].shape[1]:
        raise ValueError(f"fn takes {fn.shape[1]} columns, the streams flatten to "
                         f"{len(streams) * streams[0].shape[1]}")
    return call_op(hc_project_op, _hc_project, list(streams), _fp32(fn), float(eps),
                   kernels.direct_launch, kernels.interpret)


def hc_split_sinkhorn(kernels: Kernels, mixes: torch.Tensor, scale: torch.Tensor,
                      base: torch.Tensor, hc: int, iters: int, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` fp32 from ``mixes [T, (2 + hc) hc]``
    (``model.hyper_connection.split_sinkhorn``, one launch)."""
    from swa_bench.kernels import triton_hc

    rows = mixes.shape[0]
    if mixes.shape[1] != (2 + hc) * hc or hc > MAX_STREAMS:
        raise ValueError(f"mixes of {hc} streams are {(2 + hc) * hc} wide, got {mixes.shape[1]}")
    mixes = mixes if mixes.dtype == torch.float32 and mixes.stride(1) == 1 else _fp32(mixes)
    pre = mixes.new_empty(rows, hc)
    post = mixes.new_empty(rows, hc)
    comb = mixes.new_empty(rows, hc, hc)
    if rows:
        launch(triton_hc.hc_split_sinkhorn_kernel, (-(-rows // SINKHORN_BLOCK_R),),
            mixes, _fp32(scale), _fp32(base), pre, post, comb, rows, mixes.stride(0), eps,
            HC=hc, HC_PAD=next_pow2(hc), ITERS=iters, BLOCK_R=SINKHORN_BLOCK_R,
            direct=kernels.direct_launch, num_warps=4)
    return pre, post, comb


def hc_pre(kernels: Kernels, streams: Sequence[torch.Tensor],
           gains: torch.Tensor) -> torch.Tensor:
    """``sum_j gains[:, j] * streams[j]`` in fp32, rounded once to the streams' dtype."""
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    y = torch.empty_like(streams[0], memory_format=torch.contiguous_format)
    if rows == 0:
        return y
    gains = gains if gains.dtype == torch.float32 and gains.stride(1) == 1 else _fp32(gains)
    s = _padded(streams)
    launch(triton_hc.hc_pre_kernel, _grid(rows, dim),
        *s, gains, y, s[0].stride(0), gains.stride(0), y.stride(0), dim,
        HC=len(streams), BLOCK_D=BLOCK_D, direct=kernels.direct_launch, num_warps=4)
    return y


def hc_post(kernels: Kernels, streams: Sequence[torch.Tensor], out: torch.Tensor,
            post: torch.Tensor, comb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stream ``i`` becomes ``post[:, i] * out + sum_j comb[:, j, i] * streams[j]`` (fp32
    sums, rounded once)."""
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    hc = len(streams)
    ys = streams[0].new_empty(hc, rows, dim).unbind(0)
    if rows == 0:
        return ys
    out = out if out.stride(-1) == 1 else out.contiguous()
    post = post if post.dtype == torch.float32 and post.stride(1) == 1 else _fp32(post)
    s, y = _padded(streams), _padded(ys)
    launch(triton_hc.hc_post_kernel, _grid(rows, dim),
        out, *s, post, _fp32(comb), *y, out.stride(0), s[0].stride(0), post.stride(0),
        y[0].stride(0), dim, HC=hc, BLOCK_D=BLOCK_D, direct=kernels.direct_launch, num_warps=4)
    return ys
