"""``hc_gains``, ``hc_pre`` and ``hc_post``: the mHC gains and stream sums in one pass each
(Triton), for up to four streams; ``hc_gated_pre``: the gains and the pre sum in one launch,
``hc_post_gated_pre``: with the previous sublayer's post before them.

The model calls them when its ``Kernels`` are Triton's and no gradient is wanted (they have
no backward: training uses the PyTorch path); ``model.weighted_sum`` stays the CPU path and the
oracle. Each row's result depends on that row alone, so they are batch-invariant, and a replayed
CUDA graph runs them as eager steps do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swa_bench.kernels.config import Kernels, next_pow2
from swa_bench.kernels.launch import launch

MAX_STREAMS = 4
BLOCK_D = 1024
GAINS_BLOCK_R, GAINS_BLOCK_D = 16, 256  # rows a gains program owns; columns a step
POST_BLOCK_D = 64  # columns a step of the post fused before the gains


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


def hc_pre_folds_norm(dim: int) -> bool:
    """Whether ``hc_pre`` can apply the sublayer's RMSNorm too: one program holds the row."""
    return dim <= BLOCK_D


def hc_pre(kernels: Kernels, streams: Sequence[torch.Tensor], gains: torch.Tensor,
           norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``sum_j gains[:, j] * streams[j]`` in fp32, rounded once to the streams' dtype; with
    ``norm = (weight, eps)`` (where ``hc_pre_folds_norm``) then RMS-normed in the same launch,
    one launch a sublayer fewer on a host-bound step."""
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    if norm is not None and not hc_pre_folds_norm(dim):
        raise ValueError(f"hc_pre folds the norm for rows of at most {BLOCK_D}, got {dim}")
    y = torch.empty_like(streams[0], memory_format=torch.contiguous_format)
    if rows == 0:
        return y
    gains = gains if gains.dtype == torch.float32 else gains.float()
    s = _padded(streams)
    norm_w, eps = norm if norm is not None else (gains, 0.0)
    launch(triton_hc.hc_pre_kernel, _grid(rows, dim),
        *s, gains, y, norm_w, s[0].stride(0), gains.stride(0), y.stride(0), dim, eps,
        HC=len(streams), BLOCK_D=BLOCK_D, NORM=norm is not None, direct=kernels.direct_launch,
        num_warps=4)
    return y


def hc_post(kernels: Kernels, streams: Sequence[torch.Tensor], out: torch.Tensor,
            post: torch.Tensor, mix: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stream ``i`` becomes ``post[:, i] * out + sum_j mix[i, j] * streams[j]`` (fp32 sums)."""
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    hc = len(streams)
    ys = streams[0].new_empty(hc, rows, dim).unbind(0)
    if rows == 0:
        return ys
    out, post, mix = _post_inputs(out, post, mix)
    s, y = _padded(streams), _padded(ys)
    launch(triton_hc.hc_post_kernel, _grid(rows, dim),
        out, *s, post, mix, *y, out.stride(0), s[0].stride(0), post.stride(0), y[0].stride(0),
        dim, HC=hc, BLOCK_D=BLOCK_D, direct=kernels.direct_launch, num_warps=4)
    return ys


def hc_gains(kernels: Kernels, streams: Sequence[torch.Tensor], norm_weight: torch.Tensor,
             dyn_weight: torch.Tensor, eps: float,
             statics: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``dynamic(rms_norm(cat(streams)))`` as fp32 ``[T, 2 hc]`` without the concatenation (a
    ``hc`` times wider copy of the streams) or the normed copy: one read of the streams for the
    statistics, one for the product. With ``statics = (static_pre, static_post)`` the mHC gates
    instead: ``sigmoid(gains[:, :hc] + static_pre)`` and ``2 sigmoid(gains[:, hc:] +
    static_post)``, in the same launch."""
    rows = streams[0].shape[0]
    n_out = dyn_weight.shape[0]
    out = torch.empty(rows, n_out, dtype=torch.float32, device=streams[0].device)
    if rows == 0:
        return out
    _launch_gains(kernels, streams, norm_weight, dyn_weight, eps, statics, out)
    return out


def hc_gated_pre(kernels: Kernels, streams: Sequence[torch.Tensor],
                 norm_weight: torch.Tensor, dyn_weight: torch.Tensor, eps: float,
                 statics: tuple[torch.Tensor, torch.Tensor],
                 norm: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``hc_gains`` (the gates) and ``hc_pre`` with their pre gates in one launch, for rows
    where ``hc_pre_folds_norm``: the sublayer's input (normed with ``norm = (weight, eps)``
    when given) and the post gates ``[T, hc]``."""
    rows, dim = streams[0].shape
    if not hc_pre_folds_norm(dim):
        raise ValueError(f"hc_gated_pre takes rows of at most {BLOCK_D}, got {dim}")
    hc = len(streams)
    gates = torch.empty(rows, 2 * hc, dtype=torch.float32, device=streams[0].device)
    y = torch.empty_like(streams[0], memory_format=torch.contiguous_format)
    if rows:
        _launch_gains(kernels, streams, norm_weight, dyn_weight, eps, statics, gates, y, norm)
    return y, gates[:, hc:]


def hc_post_gated_pre(kernels: Kernels, streams: Sequence[torch.Tensor], out: torch.Tensor,
                      post: torch.Tensor, mix: torch.Tensor, norm_weight: torch.Tensor,
                      dyn_weight: torch.Tensor, eps: float,
                      statics: tuple[torch.Tensor, torch.Tensor],
                      norm: tuple[torch.Tensor, float] | None = None
                      ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """``hc_post`` of one sublayer (``streams``, its ``out``, ``post`` gains, ``mix``) and
    ``hc_gated_pre`` of the next on the new streams, in one launch, for rows where
    ``hc_pre_folds_norm``: the new streams, the next sublayer's input and its post gates."""
    rows, dim = streams[0].shape
    if not hc_pre_folds_norm(dim):
        raise ValueError(f"hc_post_gated_pre takes rows of at most {BLOCK_D}, got {dim}")
    hc = len(streams)
    ys = streams[0].new_empty(hc, rows, dim).unbind(0)
    gates = torch.empty(rows, 2 * hc, dtype=torch.float32, device=streams[0].device)
    x = torch.empty_like(streams[0], memory_format=torch.contiguous_format)
    if rows:
        out, post, mix = _post_inputs(out, post, mix)
        _launch_gains(kernels, streams, norm_weight, dyn_weight, eps, statics, gates, x, norm,
                      (out, post, mix, ys))
    return ys, x, gates[:, hc:]


def _post_inputs(out: torch.Tensor, post: torch.Tensor, mix: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A post's sublayer output with unit column stride, its gains and mixing in fp32 (the
    mixing contiguous), copied only where they are not already."""
    out = out if out.stride(-1) == 1 else out.contiguous()
    post = post if post.dtype == torch.float32 else post.float()
    mix = mix if mix.dtype == torch.float32 and mix.is_contiguous() else mix.float().contiguous()
    return out, post, mix


def _launch_gains(kernels, streams, norm_weight, dyn_weight, eps, statics, out, y=None, norm=None,
                  post_of=None):
    """One ``hc_gains_kernel`` launch: the gains into ``out``; with ``y`` the pre sum (normed
    with ``norm``); with ``post_of = (out, post, mix, new streams)`` the post before them.
    Unused pointers are given a tensor of the launch (the kernel never reads them)."""
    from swa_bench.kernels import triton_hc

    rows, dim = streams[0].shape
    dyn_weight = dyn_weight if dyn_weight.stride(-1) == 1 else dyn_weight.contiguous()
    static_pre, static_post = statics if statics is not None else (out, out)
    y_norm_w, y_eps = norm if norm is not None else (out, 0.0)
    sub_out, post, mix, ys = post_of if post_of is not None else (out, out, out, streams)
    s, n = _padded(streams), _padded(ys)
    launch(triton_hc.hc_gains_kernel, (-(-rows // GAINS_BLOCK_R),),
        *s, norm_weight, dyn_weight, static_pre, static_post, out, out if y is None else y,
        y_norm_w, sub_out, post, mix, *n, rows, s[0].stride(0), dyn_weight.stride(0),
        out.stride(0), 0 if y is None else y.stride(0), sub_out.stride(0), post.stride(0),
        n[0].stride(0), eps, y_eps, D=dim, HC=len(streams), OUT=dyn_weight.shape[0],
        OUT_PAD=max(16, next_pow2(dyn_weight.shape[0])), BLOCK_R=GAINS_BLOCK_R,
        BLOCK_D=GAINS_BLOCK_D, BLOCK_P=POST_BLOCK_D, GATES=statics is not None,
        PRE=y is not None, NORM=norm is not None, POST=post_of is not None,
        PRECISION=kernels.precision(streams[0].dtype), direct=kernels.direct_launch, num_warps=4,
        num_stages=3 if streams[0].dtype.itemsize <= 2 else 1)  # fp32 tiles: shared memory
