"""``moe_route``, ``moe_sort``, ``silu_mul`` and ``moe_combine``: the routing, the sort of the
(token, expert) pairs by expert and the routed experts' elementwise steps in one pass each
(Triton), for inference on the Triton backend (the semantics are DeepSeek-V4.1 inference/
model.py `Gate` / `Expert` / `MoE`, as ``model.moe`` states them); and
``expert_gemm``, the grouped GEMM where ``torch._grouped_mm`` does not run (fp32 on CUDA: the
check models), with the gather into expert order, the SwiGLU and the scatter back to pair order
in the same launch.

``model.MoE`` keeps the PyTorch steps as the CPU path, for training (these have no backward) and
as the oracle. Each output row depends on its own input rows alone: batch-invariant.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from swa_bench.kernels.config import Kernels, call_op, next_pow2
from swa_bench.kernels.launch import launch

BLOCK = 1024
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 32, 64, 32
ROUTE_BLOCK_R = 16
ROUTE_BLOCK_K = 64
GATE_IN_ROUTE_ELEMENTS = 1 << 16
SORT_PAIRS = 4096  # (token, expert) pairs one program sorts: a decode or mixed step's


def fused_moe(kernels: Kernels, x: torch.Tensor) -> bool:
    """Whether the experts' elementwise steps on ``x`` run here: the Triton backend is bound
    and no gradient is wanted."""
    return kernels.inference(x)


def silu_mul(kernels: Kernels, h: torch.Tensor, limit: float = 0.0,
             weights: torch.Tensor | None = None, order: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``model.moe.swiglu``: ``silu(g) * u`` of ``h = [g | u]`` ``[M, 2 I]`` as ``[M, I]``, in
    fp32 with the clamps at ``limit`` (0: none), rounded once. ``weights [T, k]`` (fp32, pair
    order) with ``order``: row ``r`` is pair ``order[r]`` and is multiplied by its weight."""
    from swa_bench.kernels import triton_moe

    rows, inter = h.shape[0], h.shape[1] // 2
    h = h if h.stride(-1) == 1 else h.contiguous()
    a = h.new_empty(rows, inter)
    weighted = weights is not None
    if weighted and order is None:
        raise ValueError("silu_mul's routing weights need the order of the rows")
    if rows:
        launch(triton_moe.silu_mul_kernel, (rows, -(-inter // BLOCK)),
            h, a, weights.contiguous() if weighted else h, order if weighted else h, inter,
            h.stride(0), a.stride(0), float(limit), CLAMP=limit > 0, WEIGHTED=weighted,
            BLOCK=BLOCK, direct=kernels.direct_launch, num_warps=4)
    return a


def expert_gemm(kernels: Kernels, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor | None,
                order: torch.Tensor | None, *, top_k: int = 0, swiglu: bool = False,
                limit: float = 0.0, weights: torch.Tensor | None = None,
                scatter: bool = False) -> torch.Tensor:
    """Each (token, expert) pair's row times its expert's ``w [G, N, K]`` (transposed), the
    pairs sorted by expert (``order[r]``: the pair at sorted row ``r``; ``ends [G]``: int32
    cumulative row ends). ``top_k``: row ``r``'s input is ``x[order[r] // top_k]``, else
    ``x[r]``. ``swiglu``: ``w`` is ``[gate; up]`` and the output ``model.moe.swiglu`` (``[M, N /
    2]``: the clamps at ``limit``, and with ``weights [T, k]`` (fp32, pair order) each row times
    its pair's routing weight). ``scatter``: row ``r`` lands at ``order[r]`` (pair order). One
    launch; no host read of ``ends``, so a captured graph replays each step's routing. ``ends``
    and ``order`` None: ``w [1, N, K]`` for every row of ``x`` (the shared expert's SwiGLU in
    one launch). A custom op under a dispatch mode, so torch's FLOP counter sees it."""
    dense = order is None
    groups = w.shape[0]
    if dense and (groups != 1 or top_k or scatter or weights is not None):
        raise ValueError("expert_gemm without order takes one weight, no gather, scatter or "
                         "routing weights")
    if weights is not None and not swiglu:
        raise ValueError("expert_gemm applies routing weights in the SwiGLU epilogue only")
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    return call_op(expert_gemm_op, _expert_gemm, x, w, ends, order,
                   None if weights is None else weights.contiguous(), top_k, swiglu,
                   float(limit), scatter, kernels.precision(x.dtype), kernels.direct_launch)


def _expert_gemm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor | None,
                 order: torch.Tensor | None, weights: torch.Tensor | None, top_k: int,
                 swiglu: bool, limit: float, scatter: bool, precision: str,
                 direct: bool) -> torch.Tensor:
    from swa_bench.kernels import triton_moe

    dense = order is None
    rows, (groups, n, k) = x.shape[0] if dense else order.numel(), w.shape
    n = n // 2 if swiglu else n
    y = x.new_empty(rows, n)
    weighted = weights is not None
    if rows:
        grid = (-(-rows // GEMM_BLOCK_M), -(-n // GEMM_BLOCK_N))
        launch(triton_moe.grouped_mm_kernel, grid,
            x, x if dense else order, w, x if dense else ends,
            weights if weighted else x, y, rows, x.stride(0), w.stride(0),
            w.stride(1), y.stride(0), limit, N=n, K=k, G=groups,
            G_PAD=max(2, next_pow2(groups)), TOP_K=top_k, SWIGLU=swiglu,
            CLAMP=swiglu and limit > 0, WEIGHTED=weighted, SCATTER=scatter, DENSE=dense,
            BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K,
            PRECISION=precision, direct=direct, num_warps=4)
    return y


expert_gemm_op = torch.library.custom_op("swa_bench::expert_gemm", _expert_gemm,
                                         mutates_args=())


@expert_gemm_op.register_fake
def _(x, w, ends, order, weights, top_k, swiglu, *args):
    rows = x.shape[0] if order is None else order.numel()
    return x.new_empty(rows, w.shape[1] // 2 if swiglu else w.shape[1])


@register_flop_formula(torch.ops.swa_bench.expert_gemm)
def _expert_gemm_flop_formula(x_shape, w_shape, ends_shape, order_shape, *args, out_shape=None,
                              **kwargs) -> int:
    """Every row meets one expert's whole ``[N, K]`` (gate and up both, under SwiGLU)."""
    rows = x_shape[0] if order_shape is None else order_shape[0]
    return 2 * rows * w_shape[1] * w_shape[2]


def moe_route(kernels: Kernels, logits: torch.Tensor, top_k: int, bias: torch.Tensor,
              route_scale: float, gate: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.moe.route`` from the gate's fp32 ``logits [T, E]``: each row's ``top_k`` experts
    (int64, highest ``sqrt(softplus(logit)) + bias`` first) and their unbiased scores over the
    scores' sum (+1e-20 for ``top_k > 1``) times ``route_scale`` (fp32), in one launch instead of
    seven. With the gate's weight ``gate [E, dim]`` (where ``gate_in_route``), ``logits`` are the
    token rows ``[T, dim]`` and the gate's product (fp32 sums) runs in the same launch: a custom
    op under a dispatch mode, so torch's FLOP counter sees that product."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    if gate is not None:
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    return call_op(moe_route_op, _moe_route, logits, top_k, bias.contiguous(),
                   float(route_scale), gate, kernels.precision(logits.dtype),
                   kernels.direct_launch)


def _moe_route(logits: torch.Tensor, top_k: int, bias: torch.Tensor, route_scale: float,
               gate: torch.Tensor | None, precision: str, direct: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    from swa_bench.kernels import triton_moe

    rows = logits.shape[0]
    n_experts = logits.shape[1] if gate is None else gate.shape[0]
    experts = torch.empty(rows, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    if rows:
        launch(triton_moe.route_kernel, (-(-rows // ROUTE_BLOCK_R),),
            logits, logits if gate is None else gate, bias, experts, weights, rows,
            logits.stride(0), 0 if gate is None else gate.stride(0), route_scale,
            E=n_experts, E_PAD=max(16, next_pow2(n_experts)), TOP_K=top_k,
            K_PAD=max(2, next_pow2(top_k)), BLOCK_R=ROUTE_BLOCK_R, GATED=gate is not None,
            DIM=logits.shape[1], BLOCK_K=ROUTE_BLOCK_K, PRECISION=precision,
            direct=direct, num_warps=4)
    return experts, weights


moe_route_op = torch.library.custom_op("swa_bench::moe_route", _moe_route, mutates_args=())


@moe_route_op.register_fake
def _(logits, top_k, bias, route_scale, gate, *args):
    rows = logits.shape[0]
    return (logits.new_empty(rows, top_k, dtype=torch.long),
            logits.new_empty(rows, top_k, dtype=torch.float32))


@register_flop_formula(torch.ops.swa_bench.moe_route)
def _moe_route_flop_formula(logits_shape, top_k, bias_shape, route_scale, gate_shape, *args,
                            out_shape=None, **kwargs) -> int:
    """The gate's product when it runs here (``gate``): 2 T E dim; routing itself is no GEMM."""
    return 0 if gate_shape is None else 2 * logits_shape[0] * gate_shape[0] * gate_shape[1]


def gate_in_route(n_experts: int, dim: int) -> bool:
    """Whether ``moe_route`` takes the gate's product too: every row block reads the whole gate
    weight, cheap for a small model's (the small preset's 8 x 256), not for V4.1's 384 x 5120
    (cuBLAS's GEMM reads it once a tile). A property of the model, not of the batch."""
    return n_experts * dim <= GATE_IN_ROUTE_ELEMENTS


def moe_sort(kernels: Kernels, experts: torch.Tensor, n_experts: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of ``experts [T, k]`` sorted by expert, stable: ``order[r]``
    (int64) is the pair at sorted row ``r``; ``ends [E]`` (int32) each expert's cumulative row
    end. ``MoE.routed``'s ``argsort``, gather, ``arange`` and ``searchsorted`` (eight launches
    with the sort's copies) in one for up to ``SORT_PAIRS`` pairs; more take those ops. Integer
    results, equal either way."""
    from swa_bench.kernels import triton_moe

    pairs = experts.flatten()
    n = pairs.numel()
    n_pad = max(16, next_pow2(n))
    if n > SORT_PAIRS or (n_experts + 1) * n_pad > 2**31:  # the sort keys stay int32
        order = torch.argsort(pairs, stable=True)
        bounds = torch.arange(1, n_experts + 1, device=pairs.device)
        return order, torch.searchsorted(pairs[order], bounds, out_int32=True)
    order = torch.empty(n, dtype=torch.long, device=pairs.device)
    ends = torch.empty(n_experts, dtype=torch.int32, device=pairs.device)
    launch(triton_moe.sort_pairs_kernel, (1,),
        pairs, order, ends, n, E=n_experts, N_PAD=n_pad,
        BINS=max(16, next_pow2(n_experts + 1)), direct=kernels.direct_launch, num_warps=4)
    return order, ends


def moe_combine(kernels: Kernels, y: torch.Tensor, order: torch.Tensor | None, top_k: int,
                out: torch.Tensor | None = None, shared: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Token ``t``'s row: ``sum_j y[pos of (t, j)]`` in fp32 where ``y`` holds the (token,
    expert) pairs' outputs, already weighted, in ``order`` (``y[i]`` is pair ``order[i]``, pair
    ``t k + j``; None: ``y`` is in pair order already), plus ``shared[t]`` (the shared expert's
    output) in fp32 when given, rounded once: the reference's fp32 accumulator. Writes into
    ``out`` ``[T, dim]`` when given."""
    from swa_bench.kernels import triton_moe

    t = y.shape[0] // top_k
    slot = None
    if order is not None:
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
    if out is None:
        out = y.new_empty(t, y.shape[1])
    if t:
        y = y if y.stride(-1) == 1 else y.contiguous()
        add = shared if shared is not None else y
        launch(triton_moe.combine_kernel, (t, -(-y.shape[1] // BLOCK)),
            y, y if slot is None else slot, add, out, y.shape[1], y.stride(0), add.stride(0),
            out.stride(0), K=top_k, SLOTTED=slot is not None, ADD=shared is not None,
            BLOCK=BLOCK, direct=kernels.direct_launch, num_warps=4)
    return out
