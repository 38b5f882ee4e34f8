"""The attention kernels' own rates: each kernel against its PyTorch path on one cold prefill.

Every problem runs through the model's attention functions (the same metadata and caches a step
uses), once with the PyTorch path and once with the Triton kernel, and both are credited the same
FLOPs: the matmul work a row's visible keys need (``mqa_attention_flops``). Each path is an
explicit ``Kernels`` value (backend, tile; launch mode and interpreter from the environment's
defaults) put in the forward context the problem runs under. The roofline of a
problem is the larger of its FLOPs at the measured GEMM rate and its minimum bytes (queries,
outputs, index lists, and the keys: once for dense sources, once per row and key when gathered)
at the measured copy bandwidth.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from swa_bench.bench.roofline import copy_bandwidth, gemm_tflops
from swa_bench.bench.timing import time_fn
from swa_bench.engine.config import kernel_settings_from_environment, resolve_kernels
from swa_bench.kernels import Kernels, KernelSettings, TileConfig, mqa_attention_flops
from swa_bench.kernels.config import TILE_CANDIDATES
from swa_bench.model.args import ModelArgs
from swa_bench.model.attention import attend
from swa_bench.model.batch import AttentionMetadata, RequestLayout, make_metadata
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import ForwardContext, set_forward_context
from swa_bench.model.key_sources import GlobalKV, causal_key_total

PROBLEMS = ("window", "compressed", "dense", "sparse")


@dataclass(frozen=True)
class KernelTiming:
    problem: str
    backend: str
    tile: str
    tokens: int
    keys_per_row: float
    median_ms: float
    flops: int
    bytes: int
    tflops: float
    gbytes_per_s: float
    roofline_pct: float
    bound: str  # "flops" or "bytes": which one sets the roofline

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Peaks:
    tflops: float
    gbytes_per_s: float


def measure_peaks(device: torch.device, dtype: torch.dtype) -> Peaks:
    """The GEMM rate in ``dtype`` and the bandwidth of a large copy (read + write)."""
    device = torch.device(device)
    nbytes = (1 << 28) if device.type == "cuda" else (1 << 22)
    return Peaks(gemm_tflops(device, dtype), copy_bandwidth(device, torch.uint8, nbytes=nbytes))


@dataclass
class Problem:
    name: str
    run: Callable[[], torch.Tensor]  # under ``context(kernels)``: layers read their kernels there
    flops: int
    bytes: int
    keys_per_row: float
    meta: AttentionMetadata
    cache: KVCache

    def context(self, kernels: Kernels) -> ForwardContext:
        """The forward context the problem's attention runs under on ``kernels``."""
        return ForwardContext(attn_metadata=self.meta,
                              logits_indices=self.meta.positions.new_zeros(0),
                              cache=self.cache, kernels=kernels)


def resident_bytes(args: ModelArgs, tokens: int, dtype: torch.dtype,
                   names: tuple[str, ...] = PROBLEMS) -> int:
    """What the problems hold at once, before any path's own workspace: the caches (built on the
    meta device, so their size is exact), queries, outputs, keys and the sparse selection."""
    cache = KVCache(args, torch.device("meta"), dtype)
    held = sum(t.numel() * t.element_size() for t in cache.tensors().values())
    elt = torch.empty((), dtype=dtype).element_size()
    held += tokens * (2 * args.n_heads + 1) * args.head_dim * elt
    if "sparse" in names:
        held += tokens * (args.index_topk or 4 * args.window) * 20  # fp32 draw, two int64
    return held


def _prefill(args: ModelArgs, tokens: int, device: torch.device, dtype: torch.dtype):
    """A cold prefill of ``tokens`` rows of one request, random queries, keys and caches."""
    layout = RequestLayout(cache_index=0, q_start=0, q_len=tokens, q_first_pos=0, kv_start=0,
                           kv_len=tokens, kv_first_pos=0, window_start=0, seq_len=tokens)
    meta: AttentionMetadata = make_metadata([layout], num_q_rows=tokens, num_kv_rows=tokens,
                                            args=args, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = KVCache(args, device, dtype)
    for latent in cache.compressed.values():
        latent.normal_(generator=gen)
    q = torch.randn(tokens, args.n_heads, args.head_dim, device=device, dtype=dtype, generator=gen)
    kv = torch.randn(tokens, args.head_dim, device=device, dtype=dtype, generator=gen)
    sink = torch.randn(args.n_heads, device=device, generator=gen)
    return meta, cache, q, kv, sink, gen


def problems(args: ModelArgs, tokens: int, device: torch.device, dtype: torch.dtype,
             names: tuple[str, ...] = PROBLEMS) -> list[Problem]:
    """A layer's attention at ``tokens`` rows: window only, compressed (the encoder's pooled
    causal KV), dense causal (the what-if preset) and sparse (window + top-k, the real model)."""
    meta, cache, q, kv, sink, gen = _prefill(args, tokens, device, dtype)
    h, d, w, elt = args.n_heads, args.head_dim, args.window, q.element_size()
    source = args.last_kv_source
    top_k = args.index_topk or 4 * args.window
    qo_bytes = 2 * q.numel() * elt
    index_bytes = tokens * w * 8
    out = []
    for name in names:
        if name == "sparse":
            chosen = torch.rand(tokens, top_k, device=device, generator=gen)
            pos = torch.arange(tokens, device=device)[:, None]
            selection = (chosen * (pos + 1)).long()
            selection = torch.where(torch.arange(top_k, device=device)[None, :] <= pos,
                                    selection, -1)
            global_kv = GlobalKV(source)
            keys = w + top_k
            out.append(Problem(
                name,
                lambda g=global_kv, s=selection: attend(
                    q, kv, meta, cache, source, g, sink, s, "varlen"),
                mqa_attention_flops(tokens, h, d, keys),
                qo_bytes + tokens * keys * (d * elt + 8),
                keys,
                meta,
                cache,
            ))
            continue
        ratio = {"window": 0, "compressed": args.compress_ratio, "dense": 1}[name]
        global_kv = GlobalKV(None) if ratio == 0 else GlobalKV(source, ratio)
        causal = causal_key_total(0, tokens, ratio) if ratio else 0
        key_rows = tokens + (tokens // ratio if ratio else 0)
        out.append(Problem(
            name,
            lambda g=global_kv: attend(q, kv, meta, cache, source, g, sink, None, "varlen"),
            mqa_attention_flops(tokens, h, d, w, causal),
            qo_bytes + index_bytes + key_rows * d * elt,
            w + causal / tokens,
            meta,
            cache,
        ))
    return out


def bench_kernels(
    args: ModelArgs,
    tokens: list[int],
    device: torch.device,
    dtype: torch.dtype,
    *,
    names: tuple[str, ...] = PROBLEMS,
    backends: tuple[str, ...] = ("torch", "triton"),
    tiles: tuple[TileConfig, ...] = (),
    warmup: int = 2,
    iters: int = 5,
    peaks: Peaks | None = None,
    on_result: Callable[[KernelTiming], None] | None = None,
) -> list[KernelTiming]:
    """Times every problem at every token count under each backend (the Triton one under each
    of ``tiles``, or the configured tile). Backends this device cannot run are left out."""
    device = torch.device(device)
    peaks = peaks or measure_peaks(device, dtype)
    runnable = [b for b in backends if b == "torch" or _can_run_triton(device)]
    results = []
    for t in tokens:
        for problem in problems(args, t, device, dtype, names):
            for backend in runnable:
                for tile in (tiles or (None,)) if backend == "triton" else (None,):
                    kernels = path_kernels(device, backend, tile)
                    causal = problem.name in CAUSAL_RANGE_PROBLEMS
                    label = kernels.tile_for(causal, dtype).label() if kernels.triton else "-"
                    with set_forward_context(problem.context(kernels)):
                        try:
                            stats = time_fn(problem.run, device=device, warmup=warmup,
                                            iters=iters)
                        except Exception as err:  # a sweep tile the device cannot fit
                            if tile is None:
                                raise
                            print(f"{problem.name} T={t} tile {label}: skipped "
                                  f"({type(err).__name__}: {str(err)[:120]})", file=sys.stderr)
                            continue
                    result = _timing(problem, backend, label, t, stats.median_ms, peaks)
                    results.append(result)
                    if on_result is not None:
                        on_result(result)
    return results


# Problems whose layers read a causal range of keys (the rest gather every key by index).
CAUSAL_RANGE_PROBLEMS = ("dense", "compressed")


def path_kernels(device: torch.device, backend: str, tile: TileConfig | None) -> Kernels:
    """The kernels one timed path runs on: ``backend`` with ``tile`` (None: the environment's
    tile, else the measured defaults), the environment's launch mode and interpreter."""
    default = kernel_settings_from_environment()
    settings = KernelSettings(backend, tile or default.tile, default.launch)
    return resolve_kernels(settings, device.type)


def _can_run_triton(device: torch.device) -> bool:
    try:
        path_kernels(device, "triton", None)
    except ValueError:
        return False
    return True


def _timing(problem: Problem, backend: str, tile: str, tokens: int, ms: float,
            peaks: Peaks) -> KernelTiming:
    seconds = ms * 1e-3
    flop_time = problem.flops / (peaks.tflops * 1e12)
    byte_time = problem.bytes / (peaks.gbytes_per_s * 1e9)
    return KernelTiming(
        problem=problem.name, backend=backend, tile=tile, tokens=tokens,
        keys_per_row=problem.keys_per_row, median_ms=ms, flops=problem.flops,
        bytes=problem.bytes, tflops=problem.flops / seconds / 1e12,
        gbytes_per_s=problem.bytes / seconds / 1e9,
        roofline_pct=100 * max(flop_time, byte_time) / seconds,
        bound="flops" if flop_time >= byte_time else "bytes",
    )


SWEEP_TILES = TILE_CANDIDATES
