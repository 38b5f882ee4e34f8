"""The hot non-GEMM kernels of a v41-flash prefill step at its real shapes, timed and checked on
the GPU: mHC's projection (bf16 streams: three exact bf16 parts on tensor cores, against the fp32
CUDA-core dot it replaced), RoPE (contiguous runs, against the strided pair loads it replaced) and
the fp32 products of bf16 operands (cuBLAS bf16 GEMM with fp32 output, against the promoted fp32
GEMM). Each: median ms of 20 after warm-up, max abs error against float64 beside the old path's.

    python3 scripts/hot_kernels_gpu.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from swa_bench.bench.timing import time_fn
from swa_bench.kernels import TORCH_KERNELS, Kernels, fp32_linear, hc_project
from swa_bench.kernels import hyper_connection as hc_module
from swa_bench.kernels.config import next_pow2
from swa_bench.model.args import PRESETS
from swa_bench.model.rope import RopeSpec, apply_rope, rope_table

TRITON = Kernels("triton")
rows_out: list[str] = []


def ms(fn) -> float:
    return time_fn(fn, device=torch.device("cuda"), warmup=3, iters=20).median_ms


def report(name: str, new_ms: float, old_ms: float, new_err: float, old_err: float) -> None:
    line = (f"| {name} | {old_ms:.3f} | {new_ms:.3f} | {old_ms / new_ms:.1f}x "
            f"| {old_err:.2e} | {new_err:.2e} |")
    rows_out.append(line)
    print(line, flush=True)


def projection(rows: int) -> None:
    args = PRESETS["v41-flash"]
    hc, dim = args.hc_mult, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    streams = [torch.randn(rows, dim, device="cuda", generator=g).bfloat16() for _ in range(hc)]
    fn = torch.randn((2 + hc) * hc, hc * dim, device="cuda", generator=g) / (hc * dim) ** 0.5
    flat = torch.cat(streams, -1).double()
    want = (flat @ fn.double().t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-20)

    def old():  # the replaced launch: fp32 CUDA-core dot, 32 x 128 tiles
        from swa_bench.kernels import triton_hc
        mixes = torch.empty(rows, fn.shape[0], device="cuda")
        s = hc_module._padded(streams)
        triton_hc.hc_project_kernel[(-(-rows // 32),)](
            *s, fn, mixes, rows, s[0].stride(0), fn.stride(0), mixes.stride(0), 1e-20, D=dim,
            HC=hc, OUT=fn.shape[0], OUT_PAD=32, BLOCK_R=32, BLOCK_D=128, SPLIT=False,
            INTERPRET=False, num_warps=4, num_stages=2)
        return mixes

    def new():
        return hc_project(TRITON, streams, fn, 1e-20)

    report(f"hc_project {rows} rows", ms(new), ms(old),
           (new().double() - want).abs().max().item(), (old().double() - want).abs().max().item())


@triton.jit
def _old_rope(X, POS, COS, SIN, stride_t, stride_h, heads, first, half,
              BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    mask = (h[:, None] < heads) & jm[None, :]
    pos = tl.load(POS + t).to(tl.int64)
    cos = tl.load(COS + pos * half + j, mask=jm, other=0.0)[None, :]
    sin = tl.load(SIN + pos * half + j, mask=jm, other=0.0)[None, :]
    at = X + t * stride_t + h[:, None] * stride_h + first + 2 * j[None, :]
    a = tl.load(at, mask=mask, other=0.0)
    b = tl.load(at + 1, mask=mask, other=0.0)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    tl.store(at, (af * cos - bf * sin).to(a.dtype), mask=mask)
    tl.store(at + 1, (af * sin + bf * cos).to(a.dtype), mask=mask)


def rope(rows: int, heads: int) -> None:
    args = PRESETS["v41-flash"]
    spec = RopeSpec.for_layer(args, 2)
    x = torch.randn(rows, heads, args.head_dim, device="cuda").bfloat16()
    positions = torch.randint(0, 65536, (rows,), device="cuda")
    cos, sin = rope_table(x.device, spec)
    want = apply_rope(x.cpu(), positions.cpu(), spec).double()  # the PyTorch path (torch kernels)
    from swa_bench.kernels import rope_

    def new():
        return rope_(TRITON, x.clone(), positions, cos, sin, spec.dim)

    def old():
        y = x.clone()
        _old_rope[(rows,)](y, positions, cos, sin, y.stride(0), y.stride(1), heads,
                           y.shape[-1] - spec.dim, spec.dim // 2, BLOCK_H=next_pow2(heads),
                           BLOCK_HALF=next_pow2(spec.dim // 2), num_warps=4)
        return y

    copy = ms(lambda: x.clone())
    report(f"rope {rows}x{heads}x{args.head_dim} (less the clone {copy:.3f})",
           ms(new) - copy, ms(old) - copy, (new().cpu().double() - want).abs().max().item(),
           (old().cpu().double() - want).abs().max().item())


def product(rows: int, n: int) -> None:
    dim = PRESETS["v41-flash"].dim
    x = torch.randn(rows, dim, device="cuda").bfloat16()
    w = (torch.randn(n, dim, device="cuda") / dim**0.5).bfloat16()
    want = x.double() @ w.double().t()

    def old():
        return F.linear(x.float(), w.float())

    def new():
        return fp32_linear(TRITON, x, w)

    assert fp32_linear(TORCH_KERNELS, x, w).dtype == torch.float32
    report(f"fp32 product {rows}x{dim} @ {n}", ms(new), ms(old),
           (new().double() - want).abs().max().item(), (old().double() - want).abs().max().item())


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    print("| kernel | old ms | new ms | speedup | old max err | new max err |")
    for rows in (16384, 896):
        projection(rows)
    for rows, heads in ((16384, 64), (16384, 1), (896, 64)):
        rope(rows, heads)
    for rows, n in ((16384, 384), (16384, 512), (896, 384)):
        product(rows, n)
    print("\n| kernel | old ms | new ms | speedup | old max err | new max err |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
