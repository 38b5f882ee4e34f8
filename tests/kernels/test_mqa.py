"""The Triton attention kernel against the model's PyTorch attention (the oracle), on CPU through
Triton's interpreter and on CUDA compiled; its FLOP formula against torch's counter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from swa_bench.checks.tolerance import Tolerance
from swa_bench.kernels import (
    TORCH_KERNELS,
    Kernels,
    KernelSettings,
    TileConfig,
    mqa_attention,
    mqa_attention_flops,
)
from swa_bench.kernels.config import TILE_CANDIDATES
from swa_bench.model.args import PRESETS
from swa_bench.model.attention import attend, gathered_attention
from swa_bench.model.key_sources import GlobalKV, causal_key_total
from tests.kernels.conftest import TRITON, attention_problem, on_kernels

ARGS = PRESETS["tiny"].replace(max_requests=4, max_seq_len=64)  # W = 8, H = 4, D = 32
# Odd lengths; a continuation whose window reaches into the ring across the W boundary; a
# one-row decode; a request whose rows start at position 0 (empty windows below it).
REQUESTS = [(0, 13), (11, 9), (30, 1), (0, 1)]


def dense(shape_mode):
    """``attend`` of a dense layer at ``shape_mode``, called as ``run`` calls it."""
    return lambda *inputs: attend(*inputs, None, shape_mode)


def sparse(shape_mode):
    return lambda *inputs: attend(*inputs, shape_mode)


def global_sources(args) -> list[GlobalKV]:
    """Window only, S's full-resolution latent, the first source's pooled latent."""
    return [GlobalKV(None), GlobalKV(args.last_kv_source),
            GlobalKV(args.kv_sources[0], ratio=args.compress_ratio)]


def run(fn, problem, *extra, backend: str):
    """``fn`` on ``backend``'s kernels, on a fresh copy of the problem's caches (the kernels
    write the ring)."""
    ring = [r.clone() for r in problem.cache.ring]
    try:
        with on_kernels(TRITON if backend == "triton" else TORCH_KERNELS):
            return fn(problem.q, problem.kv, problem.meta, problem.cache, 0, *extra[:1],
                      problem.sink, *extra[1:])
    finally:
        for mine, saved in zip(problem.cache.ring, ring, strict=True):
            mine.copy_(saved)


def assert_close(actual, expected, dtype):
    """fp32: the run's fp32 tolerance. bf16: two ulps of an O(1) output; the PyTorch path rounds
    its scores and probabilities to bf16 where the kernel keeps fp32, so they differ by rounding."""
    tol = Tolerance.for_dtype(dtype) if dtype == torch.float32 else Tolerance(2**-6, 2**-6)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol.rtol, atol=tol.atol)


def random_selection(meta, ratio: int, top_k: int, gen) -> torch.Tensor:
    """Each row's top-k visible global positions in random order, -1 where fewer are visible
    (k larger than the visible positions) and for padded rows."""
    out = torch.full((meta.num_rows, top_k), -1, dtype=torch.long)
    for lay in meta.layouts:
        for r in range(lay.q_len):
            visible = (lay.q_first_pos + r + 1) // ratio
            chosen = torch.randperm(visible, generator=gen)[:top_k]
            out[lay.q_start + r, : chosen.numel()] = chosen
    return out


def dense_cases(problem, dtype):
    for global_kv in global_sources(problem.args):
        torch_out = run(dense("varlen"), problem, global_kv, backend="torch")
        varlen = run(dense("varlen"), problem, global_kv, backend="triton")
        static = run(dense("static"), problem, global_kv, backend="triton")
        assert_close(varlen, torch_out, dtype)
        assert torch.equal(static, varlen), "FULL graphs must replay eager's bits"


def sparse_cases(problem, dtype, top_k: int):
    gen = torch.Generator().manual_seed(1)
    for global_kv in global_sources(problem.args)[1:]:
        selection = random_selection(problem.meta, global_kv.ratio, top_k, gen)
        selection = selection.to(problem.q.device)
        torch_out = run(sparse("varlen"), problem, global_kv, selection, backend="torch")
        varlen = run(sparse("varlen"), problem, global_kv, selection, backend="triton")
        static = run(sparse("static"), problem, global_kv, selection, backend="triton")
        assert_close(varlen, torch_out, dtype)
        assert torch.equal(static, varlen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_attention_kernel_matches_the_torch_path(interpreter, dtype):
    problem = attention_problem(ARGS, REQUESTS, pad=3, dtype=dtype)
    dense_cases(problem, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_kernel_matches_the_torch_path(interpreter, dtype):
    problem = attention_problem(ARGS, REQUESTS, pad=2, dtype=dtype)
    sparse_cases(problem, dtype, top_k=20)  # 20 > visible for most rows


@pytest.mark.parametrize("tile", [TileConfig(16, 16, 4, 1), TileConfig(32, 0, 4, 1)])
def test_gathered_kernel_matches_torch_for_every_tile(interpreter, tile):
    """Split output columns and block sizes that cut the index lists mid-block; an all-masked
    row comes out as zeros (the sink alone in the softmax)."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, 5, 32, generator=gen)
    kv_a, kv_b = torch.randn(40, 32, generator=gen), torch.randn(9, 32, generator=gen)
    idx_a = torch.randint(-1, 40, (7, 19), generator=gen)
    idx_b = torch.randint(-1, 9, (7, 37), generator=gen)
    idx_a[3], idx_b[3] = -1, -1
    sink = torch.randn(5, generator=gen)
    sources = [(kv_a, idx_a), (kv_b, idx_b)]
    out = mqa_attention(dataclasses.replace(TRITON, tile=tile), q, sink, 0.2, sources)
    assert_close(out, gathered_attention(q, sources, sink, 0.2), torch.float32)
    assert torch.equal(out[3], torch.zeros_like(out[3]))


def test_a_rows_result_does_not_depend_on_the_batch(interpreter):
    """Batch invariance: a row computed alone or among others gives the same bits."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 32, generator=gen)
    kv = torch.randn(30, 32, generator=gen)
    idx = torch.randint(-1, 30, (6, 23), generator=gen)
    sink = torch.randn(4, generator=gen)
    whole = mqa_attention(TRITON, q, sink, 0.3, [(kv, idx)])
    assert torch.equal(mqa_attention(TRITON, q[2:5], sink, 0.3, [(kv, idx[2:5])]), whole[2:5])


def test_flop_formula_counts_what_the_torch_path_counts(interpreter):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(9, 4, 32, generator=gen)
    sources = [(torch.randn(20, 32, generator=gen), torch.randint(-1, 20, (9, 8), generator=gen)),
               (torch.randn(12, 32, generator=gen), torch.randint(-1, 12, (9, 5), generator=gen))]
    sink = torch.zeros(4)
    with FlopCounterMode(display=False) as torch_count:
        gathered_attention(q, sources, sink, 0.1)
    with FlopCounterMode(display=False) as kernel_count:
        mqa_attention(TRITON, q, sink, 0.1, sources)
    assert kernel_count.get_total_flops() == torch_count.get_total_flops()
    assert kernel_count.get_total_flops() == mqa_attention_flops(9, 4, 32, 8 + 5)


def test_dense_kernel_counts_each_rows_window_and_visible_prefix(interpreter):
    problem = attention_problem(ARGS, REQUESTS, pad=3)
    visible = sum(lay.q_first_pos + r + 1 for lay in problem.meta.layouts for r in range(lay.q_len))
    rows = problem.q.shape[0]
    for fn in (dense("varlen"), dense("static")):
        with FlopCounterMode(display=False) as count:
            run(fn, problem, GlobalKV(ARGS.last_kv_source), backend="triton")
        h, d = ARGS.n_heads, ARGS.head_dim
        # One launch over every row: padded rows run their (masked) window blocks too.
        assert count.get_total_flops() == 4 * h * d * (rows * ARGS.window + visible)


def test_a_step_of_padded_rows_only_reads_nothing(interpreter):
    """A graph's capture runs on a step with no request: every source, both kernels, zeros."""
    problem = attention_problem(ARGS, [], pad=4)
    for global_kv in global_sources(ARGS):
        for fn in (dense("varlen"), dense("static")):
            out = run(fn, problem, global_kv, backend="triton")
            assert torch.equal(out, torch.zeros_like(out))
        if global_kv.source is not None:
            none = torch.full((4, 8), -1, dtype=torch.long)
            for fn in (sparse("varlen"), sparse("static")):
                out = run(fn, problem, global_kv, none, backend="triton")
                assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_causal_key_total_is_the_sum_of_visible_counts(ratio):
    for first in range(0, 13):
        for rows in range(0, 11):
            brute = sum((p + 1) // ratio for p in range(first, first + rows))
            assert causal_key_total(first, rows, ratio) == brute


def test_backend_choice_is_validated_and_resolved_per_device():
    """A backend that is not one is refused naming where it was written; auto is PyTorch on a
    CPU (interpreter or not) and Triton on CUDA; triton on a CPU needs the interpreter."""
    with pytest.raises(ValueError, match="SWA_BENCH_KERNELS"):
        KernelSettings.parse("cudnn", names={"backend": "SWA_BENCH_KERNELS"})
    with pytest.raises(ValueError, match="backend"):
        KernelSettings("cudnn")
    assert KernelSettings.parse("torch").resolve("cpu", interpret=True).backend == "torch"
    assert KernelSettings().resolve("cpu", interpret=False) == TORCH_KERNELS
    assert KernelSettings().resolve("cpu", interpret=True).backend == "torch"
    with pytest.raises(ValueError, match="triton needs CUDA"):
        KernelSettings("triton").resolve("cpu", interpret=False)
    pytest.importorskip("triton")
    assert KernelSettings().resolve("cuda", interpret=False).backend == "triton"
    assert KernelSettings("triton").resolve("cpu", interpret=True) == Kernels("triton",
                                                                               interpret=True)


def test_kernels_skip_the_custom_op_outside_a_dispatch_mode():
    """The FLOP counter (a dispatch mode) sees the custom op and its formula; a plain call goes
    to the kernel directly, without the op's Python dispatch."""
    from swa_bench.kernels.config import call_op

    calls = []
    op, impl = (lambda x: calls.append("op")), (lambda x: calls.append("impl"))
    call_op(op, impl, 1)
    with FlopCounterMode(display=False):
        call_op(op, impl, 1)
    assert calls == ["impl", "op"]


@pytest.mark.parametrize("text", ["32,0,8", "a,b,c,d", "24,0,8,1", "16,-5,8,1", "16,24,8,1",
                                  "16,0,0,1", "16,0,3,1", "16,0,8,0"])
def test_tile_config_rejects_bad_text(text):
    with pytest.raises(ValueError, match="^SWA_BENCH_MQA_TILE: "):
        TileConfig.parse(text, "SWA_BENCH_MQA_TILE")
    with pytest.raises(ValueError, match="^(expected|block|num)"):
        TileConfig.parse(text, "")


def test_tile_config_takes_every_candidate():
    for tile in TILE_CANDIDATES:
        assert TileConfig.parse(tile.label()) == tile


def test_default_tile_fits_each_dtype():
    """64-key blocks only where they fit the shared memory (16-bit keys): fp32 at 64 keys asked
    for 272 KiB on the H200 and failed to launch. A chosen tile replaces every default."""
    from swa_bench.kernels.config import CAUSAL_RANGE_TILE, FP32_TILE, GATHERED_TILE

    auto = TRITON
    assert auto.tile_for(True, torch.bfloat16) == CAUSAL_RANGE_TILE
    assert auto.tile_for(False, torch.bfloat16) == GATHERED_TILE
    assert auto.tile_for(True, torch.float32) == auto.tile_for(False, torch.float32) == FP32_TILE
    assert FP32_TILE.block_n == 32 and FP32_TILE.num_stages == 1
    chosen = dataclasses.replace(auto, tile=TileConfig(16, 0, 4, 1))
    assert {chosen.tile_for(c, d) for c in (True, False) for d in (torch.bfloat16, torch.float32)
            } == {TileConfig(16, 0, 4, 1)}


# --- compiled kernels on the GPU ----------------------------------------------------------------

FLASH = PRESETS["v41-flash"]
GPU_ARGS = FLASH.replace(max_requests=3, max_seq_len=2048 + 64)  # H = 64, D = 512, W = 128
# Odd lengths, a continuation whose window crosses the ring, a decode, T not a block multiple.
GPU_REQUESTS = [(0, 777), (300, 129), (1000, 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dense_kernel_on_cuda(dtype):
    problem = attention_problem(GPU_ARGS, GPU_REQUESTS, pad=5, dtype=dtype, device="cuda")
    dense_cases(problem, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_kernel_on_cuda(dtype):
    problem = attention_problem(GPU_ARGS, GPU_REQUESTS, pad=5, dtype=dtype, device="cuda")
    sparse_cases(problem, dtype, top_k=GPU_ARGS.index_topk)


@pytest.mark.cuda
@pytest.mark.parametrize("tile", [TileConfig(32, 256, 8, 1), TileConfig(64, 0, 8, 1)])
def test_gathered_kernel_tiles_on_cuda(tile):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(301, 64, 512, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(4000, 512, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(-1, 4000, (301, 640), device="cuda", generator=gen)
    idx[7] = -1
    sink = torch.randn(64, device="cuda", generator=gen)
    kernels = dataclasses.replace(TRITON, tile=tile)
    out = mqa_attention(kernels, q, sink, 512**-0.5, [(kv, idx)])
    assert_close(out, gathered_attention(q, [(kv, idx)], sink, 512**-0.5), torch.bfloat16)
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    assert torch.equal(mqa_attention(kernels, q[100:103], sink, 512**-0.5, [(kv, idx[100:103])]),
                       out[100:103])


@pytest.mark.cuda
def test_kernel_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(64, 64, 512, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(1000, 512, device="cuda", generator=gen).bfloat16()
    idx = torch.randint(-1, 1000, (64, 640), device="cuda", generator=gen)
    start = torch.zeros(64, dtype=torch.long, device="cuda")
    count = torch.randint(0, 1000, (64,), device="cuda", generator=gen)
    sink = torch.randn(64, device="cuda", generator=gen)

    def call():
        return mqa_attention(TRITON, q, sink, 0.05, [(kv, idx)], (kv, start, count, 0))

    eager = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    count.copy_(torch.randint(0, 1000, (64,), device="cuda", generator=gen))
    eager = call()
    graph.replay()
    assert torch.equal(captured, eager)
