"""``swa-bench kernels``: the attention kernels timed against their PyTorch paths
(``bench.kernels``) at a preset's shapes, each figure also a share of this device's measured
roofline.

``KernelRun.from_options`` checks every option (one ``CommandError`` line each) before the device
is touched beyond asking its free memory; ``KernelRun.run`` times and prints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from swa_bench.bench.kernels import (
    PROBLEMS,
    SWEEP_TILES,
    bench_kernels,
    measure_peaks,
    resident_bytes,
)
from swa_bench.engine.device_memory import free_bytes
from swa_bench.model.args import PRESETS, ModelArgs
from swa_bench.run.errors import CommandError


@dataclass(frozen=True)
class KernelRun:
    """What ``swa-bench kernels`` times: the device, the preset's shapes sized for the longest
    prefill, the problems and the row counts."""

    device: torch.device
    preset: str
    args: ModelArgs
    names: tuple[str, ...]
    counts: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def from_options(cls, tokens: Sequence[int] | None, preset: str | None,
                     problem: Sequence[str] | None, dtype: str) -> KernelRun:
        """The defaults follow the device: 16384 rows of v41-flash on a GPU, 48 of tiny on a CPU."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        gpu = device.type == "cuda"
        preset = preset or ("v41-flash" if gpu else "tiny")
        names = tuple(problem or PROBLEMS)
        if preset not in PRESETS:
            raise CommandError(f"--preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        if bad := [n for n in names if n not in PROBLEMS]:
            raise CommandError(f"--problem: unknown {bad[0]!r} (known: {', '.join(PROBLEMS)})")
        if dtype not in ("bfloat16", "float32"):
            raise CommandError(f"--dtype: must be bfloat16 or float32, got {dtype!r}")
        counts = tuple(tokens or [16384 if gpu else 48])
        try:
            args = PRESETS[preset].replace(max_requests=1,
                                           max_seq_len=max(max(counts), PRESETS[preset].window))
        except ValueError as err:  # a context no machine holds
            raise CommandError(f"--tokens: {max(counts)} rows: {err}") from None
        torch_dtype = getattr(torch, dtype)
        need, free = resident_bytes(args, max(counts), torch_dtype, names), free_bytes(device)
        if free is not None and need > free:
            raise CommandError(f"--tokens: {max(counts)} rows need at least {need / 2**30:.3g} "
                               f"GiB, {device.type} has {free / 2**30:.3g} GiB free")
        return cls(device, preset, args, names, counts, torch_dtype)

    def run(self, *, sweep: bool, iters: int, as_json: bool, console: Console) -> None:
        """A line per figure as it lands and the table at the end (``as_json``: the table on
        ``console``, the JSON document on stdout)."""
        args = self.args
        peaks = measure_peaks(self.device, self.dtype)
        top_k = args.index_topk or 4 * args.window
        console.print(f"{self.device.type}: GEMM {peaks.tflops:.3g} TFLOP/s, copy "
                      f"{peaks.gbytes_per_s:.0f} GB/s; preset {self.preset} (H={args.n_heads}, "
                      f"D={args.head_dim}, W={args.window}, top-k={top_k})")
        table = Table("problem", "T", "path", "tile", "keys/row", "ms", "TFLOP/s", "GB/s",
                      "% roofline", "bound", box=None)

        def add(r) -> None:
            table.add_row(r.problem, str(r.tokens), r.backend, r.tile, f"{r.keys_per_row:.0f}",
                          f"{r.median_ms:.3f}", f"{r.tflops:.3g}", f"{r.gbytes_per_s:.3g}",
                          f"{r.roofline_pct:.0f}", r.bound)
            if not as_json:
                console.print(f"  {r.problem} T={r.tokens} {r.backend} {r.tile}: "
                              f"{r.median_ms:.3f} ms, {r.tflops:.3g} TFLOP/s")

        results = bench_kernels(args, list(self.counts), self.device, self.dtype,
                                names=self.names, tiles=SWEEP_TILES if sweep else (),
                                iters=iters, peaks=peaks, on_result=add)
        console.print(table)
        if as_json:
            print(json.dumps({"device": self.device.type, "preset": self.preset,
                              "peak_tflops": peaks.tflops,
                              "peak_gbytes_per_s": peaks.gbytes_per_s,
                              "results": [r.to_dict() for r in results]}, indent=2))
