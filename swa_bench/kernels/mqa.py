"""``mqa_attention``: multi-head queries over one shared K=V latent, one softmax with a sink.

Each query row ``q [T, H, D]`` attends to up to three key sources in one softmax whose denominator
also holds a per-head sink logit: two gathered sources (``kv [N, D]`` with per-row index lists
``idx [T, K]``, -1 masked: a row's window, its top-k selection) and one contiguous source (keys
``kv[start[t] : start[t] + count[t]]``: the causal global prefix of dense attention). Scores are
never materialised: the cost is O(T x keys visited), capturable in CUDA graphs (no host reads).

It is a ``torch.library`` custom op with a FLOP formula, so torch's FLOP counter sees the same
matmul FLOPs as the PyTorch path's two bmms per source (4 H D per row and key). A contiguous
source's visited keys depend on data, so the caller passes their total (``causal_keys``), known
from host metadata. Outside a dispatch mode the kernel is called directly (``call_op``: the op's
Python dispatch is host time). The caller's ``Kernels`` give the tile, the dot precision and the
launch path, passed to the op as plain values.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels.config import Kernels, TileConfig, call_op, next_pow2
from swa_bench.kernels.launch import launch


def _mqa_attention(
    q: torch.Tensor,
    sink: torch.Tensor,
    kv_a: torch.Tensor,
    idx_a: torch.Tensor,
    kv_b: torch.Tensor | None,
    idx_b: torch.Tensor | None,
    kv_c: torch.Tensor | None,
    c_start: torch.Tensor | None,
    c_count: torch.Tensor | None,
    scale: float,
    causal_keys: int,
    tile: str,
    precision: str,
    direct: bool,
    out: torch.Tensor,
) -> None:
    from swa_bench.kernels import triton_mqa

    t, heads, d = q.shape
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"mqa_attention: out must be a {tuple(q.shape)} {q.dtype} tensor with "
                         f"unit last stride, got {tuple(out.shape)} {out.dtype}")
    if t == 0:
        return
    config = TileConfig.parse(tile)
    block_d = next_pow2(d)
    block_dv = min(config.block_dv or block_d, block_d)
    has_b, has_c = kv_b is not None, kv_c is not None
    kv_b, idx_b = (kv_b, idx_b) if has_b else (kv_a, idx_a)
    kv_c, c_start, c_count = (kv_c, c_start, c_count) if has_c else (kv_a, idx_a, idx_a)
    q = q if q.stride(-1) == 1 else q.contiguous()
    launch(triton_mqa.mqa_attention_kernel, (t, block_d // block_dv),
        q, out, sink,
        kv_a, idx_a, kv_b, idx_b, kv_c, c_start, c_count,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_a.stride(0), idx_a.stride(0), kv_b.stride(0), idx_b.stride(0), kv_c.stride(0),
        scale * triton_mqa.LOG2E,
        WIDTH_A=idx_a.shape[1], WIDTH_B=idx_b.shape[1] if has_b else 0, H=heads, D=d,
        BLOCK_H=max(16, next_pow2(heads)), BLOCK_D=block_d, BLOCK_DV=block_dv,
        BLOCK_N=config.block_n, HAS_B=has_b, HAS_C=has_c,
        PRECISION=precision, direct=direct,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


mqa_attention_op = torch.library.custom_op("swa_bench::mqa_attention", _mqa_attention,
                                           mutates_args=("out",))


@mqa_attention_op.register_fake
def _(q, sink, kv_a, idx_a, kv_b, idx_b, kv_c, c_start, c_count, scale, causal_keys, tile,
      precision, direct, out):
    return None


def mqa_attention_flops(rows: int, heads: int, head_dim: int, keys_per_row: int,
                        causal_keys: int = 0) -> int:
    """QK^T and PV over every key a row visits: 2 x 2 H D per (row, key)."""
    return 4 * heads * head_dim * (rows * keys_per_row + causal_keys)


@register_flop_formula(torch.ops.swa_bench.mqa_attention)
def _mqa_attention_flop_formula(q_shape, sink_shape, kv_a_shape, idx_a_shape, kv_b_shape,
                                idx_b_shape, kv_c_shape, c_start_shape, c_count_shape, scale,
                                causal_keys, tile, *args, out_shape=None, **kwargs) -> int:
    t, heads, d = q_shape
    width = idx_a_shape[1] + (idx_b_shape[1] if idx_b_shape is not None else 0)
    return mqa_attention_flops(t, heads, d, width, causal_keys)


def mqa_attention(
    kernels: Kernels,
    q: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    gathered: list[tuple[torch.Tensor, torch.Tensor]],
    causal: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gathered``: one or two ``(kv [N, D], idx [T, K])``; ``causal``: ``(kv, start [T],
    count [T], total keys)``. Sources are visited in this order, keys in index order; the tile
    is ``kernels.tile_for`` the kind of sources and the dtype. The result is written into
    ``out`` (shaped like ``q``; None: a fresh tensor) and returned."""
    if not 1 <= len(gathered) <= 2:
        raise ValueError(f"mqa_attention takes one or two gathered sources, got {len(gathered)}")
    (kv_a, idx_a), *rest = gathered
    kv_b, idx_b = rest[0] if rest else (None, None)
    kv_c, c_start, c_count, keys = causal if causal is not None else (None, None, None, 0)
    out = torch.empty_like(q) if out is None else out
    call_op(mqa_attention_op, _mqa_attention, q, sink, kv_a, idx_a, kv_b, idx_b, kv_c,
            c_start, c_count, float(scale), int(keys),
            kernels.tile_for(causal is not None, q.dtype).label(),
            kernels.precision(q.dtype), kernels.direct_launch, out)
    return out
