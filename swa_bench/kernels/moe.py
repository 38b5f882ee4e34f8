"""``moe_route``, ``moe_sort``, ``silu_mul`` and ``moe_combine``: the routing, the sort of the
(token, expert) pairs by expert and the routed experts' elementwise steps in one pass each
(Triton), for inference on the Triton backend; and
``expert_gemm``, the grouped GEMM where ``torch._grouped_mm`` does not run (fp32 on CUDA: the
check models), with the gather into expert order, the SwiGLU and the scatter back to pair order
in the same launch.

``model.MoE`` keeps the PyTorch steps as the CPU path, for training (these have no backward) and
as the oracle. Each output row depends on its own input rows alone: batch-invariant.
"""

from __future__ import annotations

import torch

from swa_bench.kernels.config import Kernels, next_pow2
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


def silu_mul(kernels: Kernels, h: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``h = [g | u]`` ``[M, 2 I]`` as ``[M, I]``."""
    from swa_bench.kernels import triton_moe

    rows, inter = h.shape[0], h.shape[1] // 2
    h = h if h.stride(-1) == 1 else h.contiguous()
    a = h.new_empty(rows, inter)
    if rows:
        launch(triton_moe.silu_mul_kernel, (rows, -(-inter // BLOCK)),
            h, a, inter, h.stride(0), a.stride(0), BLOCK=BLOCK,
            direct=kernels.direct_launch, num_warps=4)
    return a


def expert_gemm(kernels: Kernels, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor | None,
                order: torch.Tensor | None, *, top_k: int = 0, swiglu: bool = False,
                scatter: bool = False) -> torch.Tensor:
    """Each (token, expert) pair's row times its expert's ``w [G, N, K]`` (transposed), the
    pairs sorted by expert (``order[r]``: the pair at sorted row ``r``; ``ends [G]``: int32
    cumulative row ends). ``top_k``: row ``r``'s input is ``x[order[r] // top_k]``, else
    ``x[r]``. ``swiglu``: ``w`` is ``[gate; up]`` and the output ``silu(gate) * up`` (``[M, N /
    2]``). ``scatter``: row ``r`` lands at ``order[r]`` (pair order). One launch; no host read
    of ``ends``, so a captured graph replays each step's routing. ``ends`` and ``order`` None:
    ``w [1, N, K]`` for every row of ``x`` (the shared experts' SwiGLU in one launch)."""
    from swa_bench.kernels import triton_moe

    dense = order is None
    rows, (groups, n, k) = x.shape[0] if dense else order.numel(), w.shape
    if dense and (groups != 1 or top_k or scatter):
        raise ValueError("expert_gemm without order takes one weight, no gather or scatter")
    n = n // 2 if swiglu else n
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    y = x.new_empty(rows, n)
    if rows:
        grid = (-(-rows // GEMM_BLOCK_M), -(-n // GEMM_BLOCK_N))
        launch(triton_moe.grouped_mm_kernel, grid,
            x, x if dense else order, w, x if dense else ends, y, rows, x.stride(0),
            w.stride(0), w.stride(1), y.stride(0), N=n, K=k, G=groups,
            G_PAD=max(2, next_pow2(groups)), TOP_K=top_k, SWIGLU=swiglu, SCATTER=scatter,
            DENSE=dense, BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K,
            PRECISION=kernels.precision(x.dtype), direct=kernels.direct_launch, num_warps=4)
    return y


def moe_route(kernels: Kernels, logits: torch.Tensor, top_k: int,
              gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``MoE.route`` from the gate's ``logits [T, E]``: each row's ``top_k`` experts (int64,
    highest sigmoid first) and their sigmoid scores normalised to sum to one (fp32), in one
    launch instead of four. With the gate's weight ``gate [E, dim]`` (where ``gate_in_route``),
    ``logits`` are the token rows ``[T, dim]`` and the gate's product runs in the same launch."""
    from swa_bench.kernels import triton_moe

    rows = logits.shape[0]
    n_experts = logits.shape[1] if gate is None else gate.shape[0]
    experts = torch.empty(rows, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(rows, top_k, dtype=torch.float32, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        if gate is not None:
            gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        launch(triton_moe.route_kernel, (-(-rows // ROUTE_BLOCK_R),),
            logits, logits if gate is None else gate, experts, weights, rows, logits.stride(0),
            0 if gate is None else gate.stride(0), E=n_experts,
            E_PAD=max(16, next_pow2(n_experts)), TOP_K=top_k, K_PAD=max(2, next_pow2(top_k)),
            BLOCK_R=ROUTE_BLOCK_R, GATED=gate is not None, DIM=logits.shape[1],
            BLOCK_K=ROUTE_BLOCK_K, PRECISION=kernels.precision(logits.dtype),
            direct=kernels.direct_launch, num_warps=4)
    return experts, weights


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


def moe_combine(kernels: Kernels, y: torch.Tensor, order: torch.Tensor | None,
                weights: torch.Tensor,
                out: torch.Tensor | None = None, shared: torch.Tensor | None = None
                ) -> torch.Tensor:
    """Token ``t``'s row: ``sum_j weights[t, j] * y[pos of (t, j)]`` where ``y`` holds the
    (token, expert) pairs in ``order`` (``y[i]`` is pair ``order[i]``, pair ``t k + j``; None:
    ``y`` is in pair order already), with the PyTorch path's roundings; plus ``shared[t]`` (the
    shared experts' output) when given, rounded as the PyTorch path's sum of the two. Writes
    into ``out`` ``[T, dim]`` when given."""
    from swa_bench.kernels import triton_moe

    t, k = weights.shape
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
            y, y if slot is None else slot, weights, add, out, y.shape[1], y.stride(0),
            weights.stride(0), add.stride(0), out.stride(0), K=k, SLOTTED=slot is not None,
            ADD=shared is not None, BLOCK=BLOCK, direct=kernels.direct_launch, num_warps=4)
    return out
