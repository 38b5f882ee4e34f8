"""The fp8 GEMM kernel on the H200 (issue 28): its rate and error at V4.1-Flash's GEMM shapes
against the bf16 GEMM of the same stored values (what runs today) and torch's row-wise fp8
``_scaled_mm`` (a ceiling: one scale per row, not per 32).

Usage there: ``python3 scripts/fp8_gemm_gpu.py [tiles|shapes]`` (``tiles``: the tile sweep at
16384 rows; ``shapes``: every shape with the default tile; both by default). Prints a table per
part last; FP8_GEMM_DRY=1 runs it on CPU at a tiny size through Triton's interpreter.
"""

from __future__ import annotations

import os
import sys
import time

DRY = os.environ.get("FP8_GEMM_DRY") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from swa_bench.kernels import Kernels, quant  # noqa: E402
from swa_bench.kernels import fp8_gemm as F  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
KERNELS = Kernels("triton", interpret=DRY)
# (name, K, N) of V4.1-Flash's fp8 Linears and routed experts (model/args.py "v41-flash").
DENSE = [("wq_a", 5120, 1280), ("wq_b", 1280, 32768), ("wkv", 5120, 512),
         ("wo_b", 8192, 5120), ("wq_index", 1280, 4096), ("shared_w13", 5120, 4608),
         ("shared_w2", 2304, 5120)]
EXPERTS = [("w13", 5120, 4608), ("w2", 2304, 5120)]
N_EXPERTS, TOP_K = 384, 6
TILES = [F.GemmTile(128, 128, 8, 3), F.GemmTile(128, 128, 8, 4), F.GemmTile(128, 128, 4, 4),
         F.GemmTile(128, 256, 8, 3), F.GemmTile(64, 128, 4, 4), F.GemmTile(64, 256, 8, 3),
         F.GemmTile(256, 128, 8, 3), F.GemmTile(128, 64, 4, 5)]
if DRY:
    DENSE, EXPERTS, N_EXPERTS, TOP_K = [("tiny", 64, 32)], [("tiny", 64, 32)], 4, 2
    TILES = [F.GemmTile(16, 32, 4, 1)]


def timed(fn, reps: int = 1 if DRY else 20) -> float:
    """Median ms of ``reps`` calls after a warm-up (CUDA events; wall clock on CPU)."""
    fn()
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def operands(rows: int, k: int, n: int, groups: int = 0, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, k, device=DEVICE, generator=gen).to(torch.bfloat16)
    if groups:
        w = torch.empty(groups, n, k, device=DEVICE, dtype=torch.bfloat16)
        for e in range(groups):
            w[e] = quant.fp4_weight_quant(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02)
    else:
        w = quant.fp8_weight_quant(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
                                   ).to(torch.bfloat16)
    return x, w


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).abs().max() / ref.abs().max())


def dense_case(rows: int, k: int, n: int, tiles) -> list[tuple[str, float, float, float]]:
    """(label, ms, TFLOP/s, error) of the bf16 GEMM, row-wise _scaled_mm and each tile."""
    x, w = operands(rows, k, n)
    a, b = F.activation_operand(KERNELS, x), F.weight_operand(w)
    xq = a.values(torch.bfloat16)
    ref = a.values().double() @ b.values().double().T
    flops = 2 * rows * k * n
    out = []

    def row(label, fn, exact=True):
        ms = timed(fn)
        out.append((label, ms, flops / ms / 1e9, rel_err(fn(), ref) if exact else float("nan")))

    row("bf16 (stored values)", lambda: xq @ w.T)
    if not DRY:  # unit scales, not the per-32 ones: a rate ceiling whose values mean nothing
        sa = torch.ones(rows, 1, device=DEVICE)
        sb = torch.ones(1, n, device=DEVICE)
        row("_scaled_mm row-wise (ceiling)",
            lambda: torch._scaled_mm(a.codes, b.codes.T, sa, sb, out_dtype=torch.bfloat16),
            exact=False)
    for tile in tiles:
        row(f"fp8 {tile.label()}", lambda tile=tile: F.fp8_gemm(KERNELS, a, b, tile=tile))
    quant_ms = timed(lambda: F.activation_operand(KERNELS, x))
    out.append(("act quant (codes + scales)", quant_ms, 0.0, 0.0))
    return out


def grouped_case(tokens: int, k: int, n: int, tiles) -> list[tuple[str, float, float, float]]:
    """The routed experts' GEMM over ``tokens`` x top-k rows sorted by expert (random routing)."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    experts = torch.rand(tokens, N_EXPERTS, device=DEVICE, generator=gen).topk(TOP_K).indices
    pairs = experts.flatten().sort().values
    ends = torch.searchsorted(pairs, torch.arange(1, N_EXPERTS + 1, device=DEVICE),
                              out_int32=True)
    rows = pairs.numel()
    x, w = operands(rows, k, n, groups=N_EXPERTS)
    a, b = F.activation_operand(KERNELS, x), F.weight_operand(w)
    xq = a.values(torch.bfloat16)
    del x
    flops = 2 * rows * k * n
    out = []
    ref_rows = slice(0, min(rows, 4096))  # the float64 reference on the first rows
    ref = torch.empty(ref_rows.stop, n, dtype=torch.float64, device=DEVICE)
    start, av = 0, a.values().double()
    for g in range(N_EXPERTS):
        end = min(int(ends[g]), ref_rows.stop)
        if end > start:
            bg = F.Fp8Operand(b.codes[g], b.scales[g]).values().double()
            ref[start:end] = av[start:end] @ bg.T
        start = max(start, end)

    def row(label, fn):
        ms = timed(fn)
        out.append((label, ms, flops / ms / 1e9, rel_err(fn()[ref_rows], ref)))

    if hasattr(torch, "_grouped_mm") and not DRY:
        wt = w.transpose(-2, -1)
        row("bf16 _grouped_mm (stored values)", lambda: torch._grouped_mm(xq, wt, offs=ends))
    for tile in tiles:
        row(f"fp8 grouped {tile.label()}",
            lambda tile=tile: F.fp8_gemm(KERNELS, a, b, ends, tile=tile))
    return out


def print_table(title: str, rows: list[tuple[str, str, float, float, float]]) -> None:
    print(f"\n## {title}\n")
    print("| shape | kernel | ms | TFLOP/s | max rel err |")
    print("| --- | --- | --- | --- | --- |")
    for shape, label, ms, rate, err in rows:
        print(f"| {shape} | {label} | {ms:.3f} | {rate:.0f} | {err:.1e} |")
    sys.stdout.flush()


def main(parts: list[str]) -> None:
    big, small = (64, 16) if DRY else (16384, 896)
    if "tiles" in parts:
        table = []
        for name, k, n in DENSE[:1] + DENSE[3:4] + DENSE[5:6]:
            for label, ms, rate, err in dense_case(big, k, n, TILES):
                table.append((f"{name} {big}x{k}->{n}", label, ms, rate, err))
        for name, k, n in EXPERTS[:1]:
            for label, ms, rate, err in grouped_case(big, k, n, TILES):
                table.append((f"experts {name} {big}x{TOP_K}", label, ms, rate, err))
        print_table("tiles", table)
    if "shapes" in parts:
        table = []
        for rows in (big, small):
            for name, k, n in DENSE:
                for label, ms, rate, err in dense_case(rows, k, n, [F.DEFAULT_TILE]):
                    table.append((f"{name} {rows}x{k}->{n}", label, ms, rate, err))
            for name, k, n in EXPERTS:
                for label, ms, rate, err in grouped_case(rows, k, n, [F.DEFAULT_TILE]):
                    table.append((f"experts {name} {rows}x{TOP_K}", label, ms, rate, err))
        print_table("shapes (default tile)", table)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tiles", "shapes"])
