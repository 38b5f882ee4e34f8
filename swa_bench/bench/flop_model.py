"""Analytic FLOPs of one eager step: the matmuls each layer runs on the rows it runs them on.

A function of the model arguments, the step's requests and the kept rows of its plan, so the
ideal speedup can be read without running anything, and checked against torch's counter (the
counter sees the same matmuls: GEMMs, the batched GEMMs of attention and the indexer, the
grouped GEMMs of the routed experts). Counted as the code runs them:

* attention reads W window columns per row, plus the top-k selection (sparse) or every visible
  global position up to its chunk's last one (dense, chunked as ``attention``'s varlen walk chunks);
* the indexer scores each row of an index source against the keys up to its chunk's last
  position (causal per chunk, chunked as ``select_varlen`` chunks), in every index head; the
  fused kernel (the ``kernels`` counted for: Triton's) against the keys up to its row block's
  last visible one;
* a KV source's compressor projects every row of the batch (``wkv``, ``wgate`` above ratio 1,
  the index keys' ``wk_index``);
* S's indexer (its selection and candidate blocks, published before the cut) runs on every row
  in both paths, with its own query latent (``wq_a``; the kept rows compute it again for S's
  attention); the index sources after S score as the others (the candidate restriction is a mask);
* the MoE runs the gate, the k routed experts of each row and the shared experts;
* Engram's ``wkv`` runs on every row of the batch at each Engram layer (its table lookups are
  gathers); DSpark's ``main_proj`` and each draft layer's ``wkv`` run on the rows the replay
  layers run on (the draft blocks themselves are not run).

Elementwise work (norms, RoPE, softmax, pooling, top-k sorting) is not counted. Steps padded for a
graph run their padded rows too; this model counts the eager step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swa_bench.kernels import TORCH_KERNELS, Kernels, index_score_flops
from swa_bench.model.args import ModelArgs
from swa_bench.model.attention import varlen_chunk_rows
from swa_bench.model.key_sources import visible_counts
from swa_bench.model.precision import is_fp8, weight_format
from swa_bench.model.requests import RequestSpec
from swa_bench.model.sparse_attention import index_chunk_rows


@dataclass(frozen=True)
class QueryRows:
    """One request's query rows in one layer: ``q_len`` rows from position ``first``."""

    first: int
    q_len: int
    seq_len: int


def chunks(rows: QueryRows, chunk: int) -> list[tuple[int, int]]:
    """(rows in the chunk, one past its last position) of each chunk."""
    return [(min(rows.q_len, c0 + chunk) - c0, rows.first + min(rows.q_len, c0 + chunk))
            for c0 in range(0, rows.q_len, chunk)]


def attention_core_flops(
    args: ModelArgs, layer: int, rows: QueryRows, device: torch.device | str = "cpu"
) -> int:
    """QK^T and PV of one request's rows in ``layer``: 4 H D per (row, key column)."""
    per_key = 4 * args.n_heads * args.head_dim
    ratio = args.compress_ratio_for(layer)
    if ratio is None:
        return rows.q_len * per_key * args.window
    n_glob = rows.seq_len // ratio
    if args.index_source_for(layer) is not None:
        width = args.window + (args.index_topk if n_glob > 0 else 0)
        return rows.q_len * per_key * width
    chunk = varlen_chunk_rows(rows.q_len, n_glob, args.n_heads, args.window, device)
    total = 0
    for c, last in chunks(rows, chunk):
        total += c * per_key * (args.window + visible_counts(last - 1, rows.seq_len, ratio))
    return total


def indexer_flops(
    args: ModelArgs, layer: int, rows: QueryRows, device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> int:
    """An index source's scoring of one request's rows: its query and weight projections, then
    ``q . k`` in every index head (2 d) and the weighted head sum (2) per visible-chunk key, as
    ``kernels`` score them."""
    return sum(indexer_gemms(args, layer, rows, device, kernels).values())


def indexer_gemms(
    args: ModelArgs, layer: int, rows: QueryRows, device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> dict[str, int]:
    """``indexer_flops`` by weight (``layer_gemms``' names), the scoring as ``SCORES``."""
    if args.index_source_for(layer) != layer:
        return {}
    heads, d = args.index_n_heads, args.index_head_dim
    ratio = args.compress_ratio_for(layer)
    n_keys = rows.seq_len // ratio
    fused = kernels.triton
    total = 0
    for c, last in chunks(rows, index_chunk_rows(n_keys, heads, device, fused)):
        if fused:
            total += index_score_flops(c, last - c, n_keys, ratio, heads, d)
        else:
            total += c * heads * visible_counts(last - 1, rows.seq_len, ratio) * (2 * d + 2)
    return {"attn.wq_index.weight": rows.q_len * 2 * args.q_lora_rank * heads * d,
            "attn.w_index.weight": rows.q_len * 2 * args.dim * heads, SCORES: total}


def publication_query_flops(args: ModelArgs, num_rows: int) -> int:
    """S's query latent for its indexer on every row (``wq_a``), when S runs the indexer."""
    return num_rows * 2 * args.dim * args.q_lora_rank if args.sparse else 0


def attention_projection_gemms(args: ModelArgs, num_rows: int) -> dict[str, int]:
    """``attention_projection_flops`` by weight (``layer_gemms``' names)."""
    h_d = args.n_heads * args.head_dim
    return {"attn.wq_a.weight": num_rows * 2 * args.dim * args.q_lora_rank,
            "attn.wq_b.weight": num_rows * 2 * args.q_lora_rank * h_d,
            "attn.wo_a": num_rows * 2 * h_d * args.o_lora_rank,
            "attn.wo_b.weight": num_rows * 2 * args.o_groups * args.o_lora_rank * args.dim}


def attention_projection_flops(args: ModelArgs, num_rows: int) -> int:
    """wq_a, wq_b, wo_a (grouped), wo_b per row; wkv is counted with the KV write."""
    return sum(attention_projection_gemms(args, num_rows).values())


def kv_write_gemms(args: ModelArgs, layer: int, num_rows: int) -> dict[str, int]:
    """``kv_write_flops`` by weight (``layer_gemms``' names)."""
    out = {"attn.wkv.weight": num_rows * 2 * args.dim * args.head_dim}
    if layer in args.kv_sources:
        out["attn.compressor.wkv.weight"] = num_rows * 2 * args.dim * args.head_dim
        if args.compress_ratio_for(layer) != 1:
            out["attn.compressor.wgate.weight"] = num_rows * 2 * args.dim * args.head_dim
        if args.sparse:
            out["attn.wk_index.weight"] = num_rows * 2 * args.head_dim * args.index_head_dim
    return out


def kv_write_flops(args: ModelArgs, layer: int, num_rows: int) -> int:
    """The window latent's ``wkv`` per row; a KV source's compressor on the same rows: its
    ``wkv`` (and ``wgate`` above ratio 1, fp32) and, with sparse attention, the index keys'
    ``wk_index`` of its latent (computed on every row at static shapes; only a group's last row
    writes)."""
    return sum(kv_write_gemms(args, layer, num_rows).values())


def hyper_connection_flops(args: ModelArgs, num_rows: int) -> int:
    """One sublayer's mHC mixes: the GEMM of the flattened streams ``[T, hc dim]`` by ``hc_fn``
    ``[(2 + hc) hc, hc dim]`` (the Sinkhorn rounds and stream sums are elementwise; none for one
    stream)."""
    hc = args.hc_mult
    return 0 if hc == 1 else num_rows * 2 * hc * args.dim * (2 + hc) * hc


def moe_gemms(args: ModelArgs, num_rows: int) -> dict[str, int]:
    """``moe_flops`` by weight (``layer_gemms``' names): gate/up ``w13`` 4 dim inter, down ``w2``
    2 dim inter, for each routed expert a row runs and each shared one."""
    routed, shared = num_rows * args.n_activated_experts, num_rows * args.n_shared_experts
    w13, w2 = 4 * args.dim * args.moe_inter_dim, 2 * args.moe_inter_dim * args.dim
    return {"moe.gate.weight": num_rows * 2 * args.dim * args.n_routed_experts,
            "experts.w13": routed * w13, "experts.w2": routed * w2,
            "moe.shared_w13.weight": shared * w13, "moe.shared_w2.weight": shared * w2}


def moe_flops(args: ModelArgs, num_rows: int) -> int:
    """Gate, the k routed experts and the shared experts (gate/up and down: 6 dim inter each)."""
    return sum(moe_gemms(args, num_rows).values())


def engram_flops(args: ModelArgs, num_rows: int) -> int:
    """Engram's ``wkv`` (the concatenated rows to hc keys + one value) at every Engram layer."""
    cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
    per_layer = 2 * cols * args.engram_head_dim * args.dim * (args.hc_mult + 1)
    return num_rows * per_layer * len(args.engram_layers)


def dspark_gemms(args: ModelArgs, num_rows: int) -> dict[str, int]:
    """``dspark_flops`` by weight (``layer_gemms``' names; ``dspark.mtp.<i>.``'s)."""
    if not args.dspark_layers:
        return {}
    return {"main_proj.weight": num_rows * 2 * len(args.dspark_target_layers) * args.dim**2,
            "attn.wkv.weight": num_rows * args.dspark_layers * 2 * args.dim * args.head_dim}


def dspark_flops(args: ModelArgs, num_rows: int) -> int:
    """The draft rings' seeding: ``main_proj`` once, then each draft layer's ``wkv``."""
    return sum(dspark_gemms(args, num_rows).values())


def head_flops(args: ModelArgs, num_logits: int) -> int:
    return num_logits * 2 * args.dim * args.vocab_size


PARTS = ("projections", "attention", "indexer", "moe", "hc", "engram", "dspark", "head")
# The finer split (``layer_gemms``): each part's FLOPs by the weight that multiplies them, named
# as the model's parameters end (``<weight>`` of ``layers.<i>.<weight>``, ``dspark.mtp.<i>.`` for
# DSpark's, ``expert_pools.<i>.`` / ``moe.own_experts.`` for the routed experts'), so which
# precision a GEMM runs in is read from the same names ``model.precision`` quantises by
# (``weight_format``); the products of two activations (attention's QK^T and PV, the indexer's
# q . k) have no weight: ``SCORES``.
SCORES = "scores"


def whole_and_kept(
    requests: Sequence[RequestSpec], kept_lens: Sequence[int]
) -> tuple[list[QueryRows], list[QueryRows]]:
    """Each request's rows in the layers before the cut (its whole query) and in the replay
    layers (its ``kept_lens`` last ones)."""
    whole = [QueryRows(r.context_len, r.query_len, r.seq_len) for r in requests]
    kept = [QueryRows(r.seq_len - k, k, r.seq_len)
            for r, k in zip(requests, kept_lens, strict=True)]
    return whole, kept


def _add(into: dict[str, int], gemms: dict[str, int]) -> None:
    for name, flops in gemms.items():
        into[name] = into.get(name, 0) + flops


def layer_gemms(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> dict[str, dict[str, dict[str, int]]]:
    """``layer_flops`` one level finer: each entry's parts by weight (``SCORES`` for products
    without one). The one place the step's rows per layer are counted; ``layer_flops`` and
    ``precision_split`` sum it."""
    s = args.last_kv_source
    whole, kept = whole_and_kept(requests, kept_lens)
    num_all, num_kept = sum(r.q_len for r in whole), sum(r.q_len for r in kept)
    out: dict[str, dict[str, dict[str, int]]] = {}
    for layer in range(args.n_layers):
        parts: dict[str, dict[str, int]] = {part: {} for part in PARTS}
        rows = whole if layer < s else kept
        n = num_all if layer < s else num_kept
        _add(parts["projections"], attention_projection_gemms(args, n))
        _add(parts["projections"], kv_write_gemms(args, layer, num_all if layer <= s else n))
        parts["attention"][SCORES] = sum(attention_core_flops(args, layer, r, device)
                                         for r in rows)
        # S's indexer runs on every row, before the cut (its per-row publications).
        indexed = whole if layer <= s else kept
        for r in indexed:
            _add(parts["indexer"], indexer_gemms(args, layer, r, device, kernels))
        if layer == s and args.sparse:
            _add(parts["indexer"], {"attn.wq_a.weight": publication_query_flops(args, num_all)})
        _add(parts["moe"], moe_gemms(args, n))
        # Layer S's KV write on every row collapses with the pre-mix it was handed: its own
        # mixes run in the replay layers, on the kept rows.
        if args.hc_mult > 1:
            parts["hc"] = {"hc_attn_fn": hyper_connection_flops(args, n),
                           "hc_ffn_fn": hyper_connection_flops(args, n)}
        if layer in args.engram_layers:
            parts["engram"] = {"engram.wkv.weight":
                               engram_flops(args, num_all) // len(args.engram_layers)}
        out[str(layer)] = parts
    out["dspark"] = {**{part: {} for part in PARTS}, "dspark": dspark_gemms(args, num_kept)}
    num_logits = sum(r.query_len if r.every_row_logits else 1 for r in requests)
    out["head"] = {**{part: {} for part in PARTS},
                   "head": {"head.weight": head_flops(args, num_logits)}}
    return out


def layer_flops(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> dict[str, dict[str, int]]:
    """``step_flops`` by layer: ``"0"`` .. ``"n_layers - 1"`` (an Engram layer's lookup in its
    own), then ``"dspark"`` (the draft rings' seeding) and ``"head"``; each by part."""
    return {entry: {part: sum(gemms.values()) for part, gemms in parts.items()}
            for entry, parts in layer_gemms(args, requests, kept_lens, device, kernels).items()}


def step_flops(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> dict[str, int]:
    """FLOPs of an eager step by part (and ``total``) on ``kernels``; ``kept_lens`` are the plan's
    (each request's query length when the decoder runs on the whole batch)."""
    return sum_by_part(layer_flops(args, requests, kept_lens, device, kernels), PARTS)


def runs_on_fp8(args: ModelArgs, kernels: Kernels, weight: str) -> bool:
    """Whether the GEMMs of ``weight`` (a ``layer_gemms`` name) run on fp8 tensor cores: one of
    the reference's fp8 Linears (``precision.weight_format``), under precision fp8, with the
    kernel choice ``quantised_gemm: fp8`` (``Kernels.fp8_linears``; the runs measured here want
    no gradient). Under the default ``quantised_gemm: bf16`` every fp8/fp4 GEMM is a bf16 GEMM
    of the stored values, and the routed experts (fp4) stay so under either choice."""
    return (is_fp8(args) and kernels.quantised_gemm == "fp8"
            and weight_format(weight) == "fp8")


@dataclass(frozen=True)
class PrecisionSplit:
    """A step's FLOPs by the rate they run at: ``fp8`` on fp8 tensor cores, ``dtype`` at the
    model dtype's GEMM rate (everything else: bf16/fp32 GEMMs, attention's and the indexer's
    products). ``fp8 + dtype`` is ``step_flops``'s total."""

    fp8: int
    dtype: int


def precision_split(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
) -> PrecisionSplit:
    """``step_flops``' total split by ``runs_on_fp8``: all at the dtype rate unless precision
    fp8 runs its fp8 Linears on fp8 GEMMs (``quantised_gemm: fp8``)."""
    fp8 = other = 0
    for parts in layer_gemms(args, requests, kept_lens, device, kernels).values():
        for gemms in parts.values():
            for weight, flops in gemms.items():
                if runs_on_fp8(args, kernels, weight):
                    fp8 += flops
                else:
                    other += flops
    return PrecisionSplit(fp8=fp8, dtype=other)


def sum_by_part(entries: dict[str, dict[str, int]], parts: Sequence[str]) -> dict[str, int]:
    """Per-layer figures summed by part, with their ``total`` (the FLOP and the byte model's)."""
    out = dict.fromkeys(parts, 0)
    for entry in entries.values():
        for name, value in entry.items():
            out[name] += value
    out["total"] = sum(out.values())
    return out
