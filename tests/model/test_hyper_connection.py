"""mHC against a loop-by-loop restatement of DeepSeek-V4.1's inference code (model.py
`Block.hc_mixes/hc_pre/hc_post/forward`, `Transformer.forward`, `make_identity_pre_mix`;
kernel_cpu.py `hc_split_sinkhorn`), in float64 Python scalars, written here from the reference's
formulas and never from the model's code."""

from __future__ import annotations

import math

import torch
from torch import nn

from swa_bench.kernels.config import TORCH_KERNELS
from swa_bench.model.args import PRESETS
from swa_bench.model.forward_context import ForwardContext, set_forward_context
from swa_bench.model.hyper_connection import split_sinkhorn
from swa_bench.model.model import build_model

HC, ITERS, EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_split(mix: list[float], scale: list[float], base: list[float], hc: int = HC,
              iters: int = ITERS, eps: float = EPS):
    """One row of `hc_split_sinkhorn`: pre, post, comb[j][i] (j: residual stream, i: new)."""
    pre = [sigmoid(mix[k] * scale[0] + base[k]) + eps for k in range(hc)]
    post = [2 * sigmoid(mix[hc + k] * scale[1] + base[hc + k]) for k in range(hc)]
    comb = [[mix[2 * hc + j * hc + i] * scale[2] + base[2 * hc + j * hc + i] for i in range(hc)]
            for j in range(hc)]
    for j in range(hc):  # softmax over the last axis, then + eps
        top = max(comb[j])
        e = [math.exp(v - top) for v in comb[j]]
        comb[j] = [v / sum(e) + eps for v in e]

    def columns():
        for i in range(hc):
            total = sum(comb[j][i] for j in range(hc)) + eps
            for j in range(hc):
                comb[j][i] /= total

    columns()
    for _ in range(iters - 1):
        for j in range(hc):
            total = sum(comb[j]) + eps
            comb[j] = [v / total for v in comb[j]]
        columns()
    return pre, post, comb


def ref_mixes(streams: list[list[float]], fn: torch.Tensor, scale, base):
    """One row of `hc_mixes`: the flattened streams projected by ``fn``, times one rsqrt of
    their mean square (no norm weight), then split."""
    flat = [v for s in streams for v in s]
    rsqrt = 1.0 / math.sqrt(sum(v * v for v in flat) / len(flat) + NORM_EPS)
    mix = [sum(w * v for w, v in zip(row, flat, strict=True)) * rsqrt for row in fn.tolist()]
    return ref_split(mix, scale.tolist(), base.tolist())


def ref_pre(streams, pre_mix):
    return [sum(pre_mix[j] * streams[j][c] for j in range(HC)) for c in range(len(streams[0]))]


def ref_post(x, residual, post, comb):
    return [[post[i] * x[c] + sum(comb[j][i] * residual[j][c] for j in range(HC))
             for c in range(len(x))] for i in range(HC)]


def ref_rms_norm(x, weight):
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + NORM_EPS)
    return [v * r * w for v, w in zip(x, weight, strict=True)]


class Tanh(nn.Module):
    """A stand-in sublayer: each row's output a function of that row alone, so the test's loop
    restates a block without attention or experts."""

    indexes_before_cut = False  # a dense stand-in: S publishes no selection

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = gain

    def forward(self, x, kv=None):
        return torch.tanh(self.gain * x)

    def project_kv(self, x):
        return x


def ref_tanh(x, gain):
    return [math.tanh(gain * v) for v in x]


def test_split_sinkhorn_is_the_reference_formula():
    g = torch.Generator().manual_seed(0)
    mixes = torch.randn(5, (2 + HC) * HC, generator=g, dtype=torch.float64) * 3
    scale = torch.rand(3, generator=g, dtype=torch.float64) + 0.5
    base = torch.randn((2 + HC) * HC, generator=g, dtype=torch.float64)
    pre, post, comb = split_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    for r in range(5):
        want_pre, want_post, want_comb = ref_split(mixes[r].tolist(), scale.tolist(),
                                                   base.tolist())
        torch.testing.assert_close(pre[r].double(), torch.tensor(want_pre, dtype=torch.float64))
        torch.testing.assert_close(post[r].double(), torch.tensor(want_post,
                                                                  dtype=torch.float64))
        torch.testing.assert_close(comb[r].double(), torch.tensor(want_comb,
                                                                  dtype=torch.float64))
    # 20 rounds leave comb doubly stochastic up to the eps terms
    torch.testing.assert_close(comb.sum(1), torch.ones(5, HC, dtype=torch.float32), atol=1e-4,
                               rtol=0)
    torch.testing.assert_close(comb.sum(2), torch.ones(5, HC, dtype=torch.float32), atol=1e-4,
                               rtol=0)


def stand_in_model(seed: int = 0, **overrides):
    args = PRESETS["tiny"].replace(dim=16, **overrides)
    model, _ = build_model(args, seed=seed)
    for i, block in enumerate(model.layers):
        block.attn, block.moe = Tanh(0.5 + 0.1 * i), Tanh(1.5 - 0.1 * i)
    return model


def ref_forward(model, x: torch.Tensor, delayed: bool = True):
    """`Transformer.forward` restated row by row: embedding repeated hc times, a one-hot
    pre-mix; each block's attention collapses with the pre-mix handed in and its FFN with the
    attention's pre; the head collapses with the last FFN pre, then the norm. ``delayed=False``:
    each sublayer collapses with its own pre instead (what the test must tell apart)."""
    out_streams, out_pre, heads = [], [], []
    for row in x.tolist():
        streams = [list(row) for _ in range(HC)]
        pre_mix = [1.0] + [0.0] * (HC - 1)
        for i, block in enumerate(model.layers):
            attn_pre, post, comb = ref_mixes(streams, block.hc_attn_fn, block.hc_attn_scale,
                                             block.hc_attn_base)
            if not delayed:
                pre_mix = attn_pre
            h = ref_rms_norm(ref_pre(streams, pre_mix), block.attn_norm.weight.tolist())
            streams = ref_post(ref_tanh(h, 0.5 + 0.1 * i), streams, post, comb)
            ffn_pre, post, comb = ref_mixes(streams, block.hc_ffn_fn, block.hc_ffn_scale,
                                            block.hc_ffn_base)
            h = ref_rms_norm(ref_pre(streams, attn_pre if delayed else ffn_pre),
                             block.ffn_norm.weight.tolist())
            streams = ref_post(ref_tanh(h, 1.5 - 0.1 * i), streams, post, comb)
            pre_mix = ffn_pre
        out_streams.append(streams)
        out_pre.append(pre_mix)
        heads.append(ref_rms_norm(ref_pre(streams, pre_mix), model.norm.weight.tolist()))
    return out_streams, out_pre, heads


def test_the_stack_carries_the_delayed_pre_mix():
    model = stand_in_model()
    ids = torch.tensor([3, 17, 100])
    want_streams, want_pre, want_head = ref_forward(model, model.embed(ids))
    ctx = ForwardContext(None, torch.tensor([0, 2]), None, TORCH_KERNELS)
    with torch.no_grad(), set_forward_context(ctx):
        logits, streams, pre_mix, _ = model(ids)
    for r in range(3):
        for i in range(HC):
            torch.testing.assert_close(streams[i][r].double(),
                                       torch.tensor(want_streams[r][i], dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pre_mix[r].double(),
                                   torch.tensor(want_pre[r], dtype=torch.float64))
    head = model.head.weight.double()
    want_logits = torch.stack([head @ torch.tensor(want_head[r], dtype=torch.float64)
                               for r in (0, 2)])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), want_logits, rtol=1e-5, atol=1e-5)
    undelayed, _, _ = ref_forward(model, model.embed(ids), delayed=False)
    assert not torch.allclose(streams[0][0].double(),
                              torch.tensor(undelayed[0][0], dtype=torch.float64), atol=1e-3)


def test_one_stream_is_a_plain_residual():
    """``hc_mult == 1``: no mHC weights, a pre-mix of ones, ``stream + out`` per sublayer."""
    model = stand_in_model(hc_mult=1)
    assert not [n for n, _ in model.named_parameters() if ".hc_" in n]
    ids = torch.tensor([5, 9])
    x = model.embed(ids)
    with torch.no_grad():
        want = x.clone()
        for i, block in enumerate(model.layers):
            want = want + torch.tanh((0.5 + 0.1 * i) * block.attn_norm(want))
            want = want + torch.tanh((1.5 - 0.1 * i) * block.ffn_norm(want))
        ctx = ForwardContext(None, torch.tensor([1]), None, TORCH_KERNELS)
        with set_forward_context(ctx):
            _, streams, pre_mix, _ = model(ids)
    assert torch.equal(pre_mix, torch.ones(2, 1))
    torch.testing.assert_close(streams[0], want)


def test_mhc_weights_are_fp32_and_padded_rows_stay_zero():
    """The reference's fp32 mHC weights and head in a bf16 model; a zero (padded) row gives zero
    mixes through ``rsqrt(0 + 1e-20) * 0``, never NaN."""
    model, _ = build_model(PRESETS["tiny"], dtype=torch.bfloat16)
    assert model.layers[0].hc_attn_fn.dtype == torch.float32
    assert model.head.weight.dtype == torch.float32
    assert model.layers[0].attn_norm.weight.dtype == torch.bfloat16
    zeros = (torch.zeros(2, model.args.dim, dtype=torch.bfloat16),) * HC
    hc = model.layers[0].hc
    mixes = model.layers[0].hc_mixes("attn", zeros)
    assert torch.isfinite(mixes.comb).all() and torch.isfinite(mixes.pre).all()
    assert torch.equal(hc.pre(zeros, mixes.pre), zeros[0])
