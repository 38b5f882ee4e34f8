"""Routed experts plus the shared expert, dispatched as serving engines do.

What is computed is DeepSeek-V4.1 inference/model.py's `Gate`, `Expert` and `MoE`: sqrt-softplus
scores of an fp32 gate product, an aux-free bias that picks the experts (never weights them), the
chosen unbiased scores normalised (+1e-20) times ``route_scale``; each expert's SwiGLU in fp32
with the clamps at ``swiglu_limit`` and the routing weight applied before ``w2``; the routed sum
and the shared expert accumulated in fp32 and rounded once to the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from swa_bench.kernels import (
    Kernels,
    expert_gemm,
    fp32_linear,
    fused_moe,
    gate_in_route,
    moe_combine,
    moe_route,
    moe_sort,
    silu_mul,
)
from swa_bench.model.args import ModelArgs
from swa_bench.model.forward_context import active_kernels
from swa_bench.model.precision import expert_input, fp8_linear, linear_input, runs_fp8_gemm

GROUPED_FALLBACK_ELEMENTS = 1 << 28  # outputs of the fallback's dense GEMM per chunk of groups


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` rows sorted by group, ``w [G, N, K]``, ``ends [G]`` int32 cumulative row ends:
    row block g times ``w[g].T``. ``torch._grouped_mm`` (CUDA bf16 on sm90, and CPU) where it
    exists (CPU's is fast only on a row-major ``[G, K, N]``: the small CPU weights are copied).

    Elsewhere (fp32/fp16 on CUDA: the check models; their inference on the Triton backend takes
    ``expert_gemm`` instead) one GEMM runs every row against a chunk of groups' weights at once
    and each row keeps its own group's columns: device-side groups, no host read of ``ends``, so
    a captured graph replays the routing of each step (a host loop would freeze the capture's
    partition), eager and graph runs compute it alike, and a small step launches a few kernels,
    not a few per group. G times the arithmetic: never the timed bf16 path. Rows past
    ``ends[-1]`` come out zero."""
    cpu = x.device.type == "cpu"
    if (cpu and hasattr(torch, "_grouped_mm")) or native_grouped_mm(x):
        b = w.transpose(-2, -1)
        return torch._grouped_mm(x, b.contiguous() if cpu else b, offs=ends)
    return grouped_mm_dense(x, w, ends)


GROUPED_MM_ALIGN_BYTES = 16  # torch._grouped_mm: "strides should be multiple of 16 bytes"


def grouped_mm_problems(args: ModelArgs, device_type: str,
                        dtype: torch.dtype) -> list[tuple[str, str]]:
    """(field, message) for each width that ``torch._grouped_mm`` cannot take where ``grouped_mm``
    calls it (CPU, and CUDA in bfloat16): the rows of ``x`` and ``w`` (``dim``, ``moe_inter_dim``
    and its double) must be a multiple of 16 bytes long, or every case raises at its first MoE
    layer. Empty elsewhere (the fallback takes any width) and for a model without routed
    experts."""
    if args.n_routed_experts == 0 or not (device_type == "cpu" or dtype == torch.bfloat16):
        return []
    size = torch.empty((), dtype=dtype).element_size()
    step = GROUPED_MM_ALIGN_BYTES // math.gcd(GROUPED_MM_ALIGN_BYTES, size)
    return [(field, f"must be a multiple of {step} for the experts' grouped GEMM in "
                    f"{str(dtype).removeprefix('torch.')} on {device_type} (its rows must be "
                    f"{GROUPED_MM_ALIGN_BYTES}-byte aligned), got {value}")
            for field, value in (("dim", args.dim), ("moe_inter_dim", args.moe_inter_dim))
            if value % step]


def native_grouped_mm(x: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x``'s GEMMs on CUDA (bf16, sm90); elsewhere the Triton
    backend's inference takes ``expert_gemm``, training and the PyTorch backend the fallback."""
    return hasattr(torch, "_grouped_mm") and x.device.type == "cuda" and x.dtype == torch.bfloat16


def grouped_mm_dense(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``grouped_mm`` by dense GEMMs over chunks of groups, each row keeping its group's part."""
    m, (g_total, n, k) = x.shape[0], w.shape
    row = torch.arange(m, device=x.device, dtype=ends.dtype)
    group = torch.searchsorted(ends, row, right=True)
    per_chunk = max(1, GROUPED_FALLBACK_ELEMENTS // max(1, m * n))
    out = None
    for g0 in range(0, g_total, per_chunk):
        g1 = min(g_total, g0 + per_chunk)
        y = (x @ w[g0:g1].reshape(-1, k).t()).view(m, g1 - g0, n)
        local = group - g0 if g0 else group
        if g1 - g0 == 1:
            mine = y[:, 0]
        else:
            pick = local.clamp(0, g1 - g0 - 1)
            mine = y.gather(1, pick.view(m, 1, 1).expand(m, 1, n)).squeeze(1)
        inside = (local < g1 - g0) if g0 == 0 else (group >= g0) & (group < g1)
        out = torch.where(inside[:, None], mine, 0.0 if out is None else out)
    return out


class Gate(nn.Module):
    """DeepSeek-V4.1 inference/model.py `Gate` (score_func sqrtsoftplus, gate_temp 1): ``weight
    [E, dim]``, and ``bias [E]``, the aux-free load-balancing bias, which steers the choice of
    experts only (the reference keeps it fp32; here it has the model's dtype, read as fp32)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.top_k, self.route_scale = args.n_activated_experts, args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The gate's product in fp32 (of the model-dtype rows and weight), as the reference's."""
        return fp32_linear(active_kernels(), x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.logits(x), self.bias, self.top_k, self.route_scale)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``top_k`` experts ``[T, k]`` (highest biased score first) and their fp32
    weights: ``scores = sqrt(softplus(logits))``, the experts chosen by ``scores + bias``, the
    weights the chosen *unbiased* scores over their sum (+1e-20, only for ``top_k > 1``) times
    ``route_scale``."""
    scores = F.softplus(logits.float()).sqrt()
    experts = (scores + bias.float()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * route_scale


def swiglu(h: torch.Tensor, limit: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V4.1 inference/model.py `Expert` between its GEMMs: ``h = [gate | up]`` (the
    gate/up GEMM's output, model dtype) to ``silu(gate) * up`` in fp32, with ``up`` clamped to
    ``[-limit, limit]`` and ``gate`` from above at ``limit`` (``limit`` 0: no clamp), times the
    routing ``weights`` (fp32, broadcast over the last dim) when given, rounded once to h's
    dtype: the weight multiplies before ``w2``."""
    gate, up = h.float().chunk(2, dim=-1)
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    a = F.silu(gate) * up
    if weights is not None:
        a = weights * a
    return a.to(h.dtype)


def combine_pairs(y: torch.Tensor, order: torch.Tensor, top_k: int, shared: torch.Tensor | None,
                  out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The expert-sorted pair outputs ``y`` (already weighted) back to their pairs, each row's
    ``top_k`` summed in fp32 with the shared expert's output, rounded once to ``dtype``, written
    into ``out`` when given (the reference's fp32 ``y`` then ``type_as(x)``)."""
    y = torch.zeros_like(y).index_copy_(0, order, y)
    summed = y.view(-1, top_k, y.shape[-1]).sum(dim=1, dtype=torch.float32)
    if shared is not None:
        summed = summed + shared
    summed = summed.to(dtype)
    return summed if out is None else out.copy_(summed)


class RoutedExperts(nn.Module):
    """Routed expert weights: ``w13 [E, 2 * inter, dim]`` (gate, up: the reference's ``w1``,
    ``w3``), ``w2 [E, dim, inter]``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, inter = args.n_routed_experts, args.moe_inter_dim
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, args.dim))
        self.w2 = nn.Parameter(torch.empty(e, args.dim, inter))


MOE_ROWS = 16384  # tokens routed per chunk: the sorted copies stay a few GiB at 64K tokens


class MoE(nn.Module):
    """Top-k routed experts plus the shared expert, dispatched as serving engines do.

    Each token's (token, expert) pairs are sorted by expert (stable, so ties keep token order), the
    rows are gathered and run through a grouped GEMM whose group ends are computed on the device
    (``searchsorted``, no host sync: capturable at static shapes); the SwiGLU applies each pair's
    routing weight, the down projection's outputs return to their pairs and each token sums its
    k in fp32 with the shared expert's output. Unselected experts do no work. Every dispatch
    path (the grouped GEMM, its dense fallback, the Triton ``expert_gemm``, the ``MOE_ROWS``
    chunks) computes `MoE` of the reference.
    """

    def __init__(self, args: ModelArgs, shared_experts: RoutedExperts | None = None) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_routed_experts, args.n_activated_experts
        self.inter = args.moe_inter_dim
        self.route_scale, self.swiglu_limit = args.route_scale, args.swiglu_limit
        self.args = args
        self.gate = Gate(args)
        # A pool shared with other layers stays unregistered (the model owns it).
        self.own_experts = RoutedExperts(args) if shared_experts is None else None
        self.shared_pool = (shared_experts,)
        shared = args.n_shared_experts * self.inter
        self.shared_w13 = nn.Linear(args.dim, 2 * shared, bias=False) if shared else None
        self.shared_w2 = nn.Linear(shared, args.dim, bias=False) if shared else None

    @property
    def experts(self) -> RoutedExperts:
        return self.own_experts if self.own_experts is not None else self.shared_pool[0]

    def route(self, x: torch.Tensor, fused: Kernels | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``Gate``: each row's top-k experts ``[T, k]`` and their fp32 weights (``fused``: in
        one kernel, ``moe_route``, with the gate's product where ``gate_in_route``)."""
        gate = self.gate
        if fused is not None and gate_in_route(*gate.weight.shape):
            return moe_route(fused, x, self.top_k, gate.bias, self.route_scale, gate.weight)
        if fused is not None:
            return moe_route(fused, gate.logits(x), self.top_k, gate.bias, self.route_scale)
        return gate(x)

    def routed(self, x: torch.Tensor, out: torch.Tensor | None = None,
               fused: Kernels | None = None, shared: torch.Tensor | None = None,
               x_in: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' sum for each row of ``x``, plus ``shared`` (the shared expert's
        output of those rows) when given, written into ``out`` when given; ``fused``: the
        inference kernels these rows run on (``fused_moe``, decided once per forward), None: the
        PyTorch steps; ``x_in``: ``x`` as the experts' GEMMs read it (default: ``expert_input``)."""
        k, limit = self.top_k, self.swiglu_limit
        experts, weights = self.route(x, fused)
        if fused is not None:
            order, ends = moe_sort(fused, experts, self.n_experts)
        else:
            pairs = experts.flatten()
            order = torch.argsort(pairs, stable=True)
            bounds = torch.arange(1, self.n_experts + 1, device=x.device)
            ends = torch.searchsorted(pairs[order], bounds, out_int32=True)
        w, args = self.experts, self.args
        x_in = expert_input(args, x) if x_in is None else x_in  # the route reads x as is
        if fused is not None and not native_grouped_mm(x):  # gather, SwiGLU, scatter in GEMMs
            a = expert_gemm(fused, x_in, w.w13, ends, order, top_k=k, swiglu=True, limit=limit,
                            weights=weights)
            y = expert_gemm(fused, expert_input(args, a), w.w2, ends, order, scatter=True)
            return moe_combine(fused, y, None, k, out, shared)
        h = grouped_mm(x_in.index_select(0, order // k), w.w13, ends)
        if fused is not None:
            a = expert_input(args, silu_mul(fused, h, limit, weights, order))
            return moe_combine(fused, grouped_mm(a, w.w2, ends), order, k, out, shared)
        a = expert_input(args, swiglu(h, limit, weights.flatten()[order][:, None]))
        return combine_pairs(grouped_mm(a, w.w2, ends), order, k, shared, out, x.dtype)

    def shared_experts(self, x_in: torch.Tensor, fused: Kernels | None) -> torch.Tensor | None:
        """The shared expert (the reference's ``shared_experts``: the routed experts' clamped
        SwiGLU, weight 1) of ``x_in``, the rows as its fp8 GEMM reads them (``linear_input``)."""
        if self.shared_w13 is None:
            return None
        limit = self.swiglu_limit
        fp8 = runs_fp8_gemm(self.args, x_in, self.shared_w13.weight)  # fp8_gemm, then SwiGLU
        if fused is not None and not native_grouped_mm(x_in) and not fp8:  # one launch
            a = expert_gemm(fused, x_in, self.shared_w13.weight[None], None, None, swiglu=True,
                            limit=limit)
        elif fused is not None:
            a = silu_mul(fused, fp8_linear(self.args, self.shared_w13, x_in), limit)
        else:
            a = swiglu(fp8_linear(self.args, self.shared_w13, x_in), limit)
        return fp8_linear(self.args, self.shared_w2, linear_input(self.args, a))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert runs first: the routed experts' combine adds its output."""
        kernels = active_kernels()
        fused = kernels if fused_moe(kernels, x) else None
        x_fp8 = linear_input(self.args, x)  # quantised once: the shared and (w4a8) routed GEMMs
        shared = self.shared_experts(x_fp8, fused)
        x_in = expert_input(self.args, x, x_fp8)
        if x.shape[0] <= MOE_ROWS:
            return self.routed(x, fused=fused, shared=shared, x_in=x_in)
        out = x.new_empty(x.shape)
        for r in range(0, x.shape[0], MOE_ROWS):
            rows = slice(r, r + MOE_ROWS)
            self.routed(x[rows], out[rows], fused, None if shared is None else shared[rows],
                        x_in[rows])
        return out
