"""Analytic bytes one eager step moves, per layer: the memory side of the roofline beside the FLOPs.

A function of the model arguments, the step's requests and the kept rows of its plan, as
``flop_model.step_flops`` is (the same rows per layer: the whole batch before the cut and for S's
batch-KV part, the kept rows in the replay layers), in the storage formats a ``WeightFormats``
gives. Counted as the code runs it, each item once per call that reads it:

* **weights**: every GEMM weight once per call (a chunked call, once per chunk: the MoE's gate
  per ``MOE_ROWS`` rows, mHC's mixes per ``HC_ROWS``, Engram's ``wkv`` per ``ENGRAM_ROWS``); S's
  ``wq_a`` twice with an indexer (its publications' query latent on every row, then its
  attention's on the kept rows); the head, the draft rings' ``main_proj`` and ``wkv``;
* **experts**: the routed experts' ``w13`` and ``w2`` of each distinct expert a routed row of the
  call touches, plus the shared experts once. Unless measured counts are given, a call of ``n``
  rows is ASSUMED to route uniformly: each row picks ``k`` of the ``E`` experts at random,
  independently, so ``E (1 - (1 - k / E)^n)`` distinct experts are expected
  (``expected_distinct_experts``; at 896 rows top-6 of 384 that is all but 3e-6 of them);
* **kv_read**: the keys a request's rows read in a layer, each distinct key once (the floor: the
  rows of a request that share a key read it from memory once, later reads hit the cache): its
  window's ``q + min(first, W - 1)`` positions, its selected positions (sparse: ``q x top-k``,
  at most the visible ones); dense global keys and the indexer's keys once per chunk of rows
  (the chunk's causal prefix is one GEMM operand, as ``flop_model`` counts its FLOPs);
* **kv_write**: each request's last ``min(q, W)`` rows into a ring (the slots that keep them),
  the compressed KV and index keys of the groups the step completes, the draft rings;
* **activations**: each layer's input and output mHC streams (``hc_mult x dim`` a row, and the
  fp32 pre-mix), S's input again on every row for its batch KV, Engram's streams, the head's
  rows and fp32 logits;
* **gathers**: the embedding rows and Engram's table rows the step looks up.

Not counted: activations inside a layer (queries, scores, the MoE's sorted rows), index lists,
the compressor's fp32 group ring, the replay route's gather and scatter of kept rows, a graph's
padded rows (an eager step, as ``flop_model``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from swa_bench.bench.flop_model import QueryRows, chunks, layer_flops, sum_by_part, whole_and_kept
from swa_bench.kernels import TORCH_KERNELS, Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.attention import varlen_chunk_rows
from swa_bench.model.engram import ENGRAM_ROWS
from swa_bench.model.hyper_connection import HC_ROWS
from swa_bench.model.key_sources import visible_counts
from swa_bench.model.moe import MOE_ROWS
from swa_bench.model.requests import RequestSpec
from swa_bench.model.sparse_attention import index_chunk_rows

PARTS = ("weights", "experts", "kv_read", "kv_write", "activations", "gathers")


@dataclass(frozen=True)
class StorageFormat:
    """How a matrix ``[rows, cols]`` (``cols`` the reduction dim K, or a key's features) is
    stored: ``element_bytes`` a value, plus one ``scale_bytes`` scale per block of
    ``block_rows x block_cols`` values (``block_cols`` 0: no scales), a partial block scaled too."""

    element_bytes: float
    block_rows: int = 1
    block_cols: int = 0
    scale_bytes: int = 1

    def matrix_bytes(self, rows: int, cols: int) -> int:
        values = rows * cols * self.element_bytes
        if self.block_cols:
            values += (math.ceil(rows / self.block_rows) * math.ceil(cols / self.block_cols)
                       * self.scale_bytes)
        return math.ceil(values)


FP32 = StorageFormat(4)  # mHC's mixes, the pre-mix and the head: fp32 in every model dtype


@dataclass(frozen=True)
class WeightFormats:
    """The storage format of each class of bytes a step moves."""

    dense: StorageFormat  # attention, compressor, indexer, gate, shared experts, Engram, DSpark
    experts: StorageFormat  # the routed experts
    window_kv: StorageFormat
    compressed_kv: StorageFormat  # every KV source's compressor output (S's: full resolution)
    index_keys: StorageFormat
    activations: StorageFormat  # the mHC streams between layers
    head: StorageFormat = FP32  # the reference keeps the head fp32 (``FP32_PARAMETERS``)

    @classmethod
    def of_dtype(cls, dtype: torch.dtype) -> WeightFormats:
        """Everything in the model dtype (what swa-bench runs today), the head fp32."""
        plain = StorageFormat(torch.empty((), dtype=dtype).element_size())
        return cls(plain, plain, plain, plain, plain, plain)

    @classmethod
    def release(cls) -> WeightFormats:
        """DeepSeek's shipped formats (issue 28): fp8 e4m3 dense weights with a UE8M0 scale per
        32x32 block, fp4 e2m1 experts with a scale per 32 along K, fp8 window KV with a scale per
        32, fp4 compressed KV and index keys with a scale per 16; bf16 streams."""
        return cls(
            dense=StorageFormat(1, 32, 32),
            experts=StorageFormat(0.5, 1, 32),
            window_kv=StorageFormat(1, 1, 32),
            compressed_kv=StorageFormat(0.5, 1, 16),
            index_keys=StorageFormat(0.5, 1, 16),
            activations=StorageFormat(2),
        )


def expected_distinct_experts(n_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts ``rows`` rows touch when each picks ``top_k`` of ``n_experts`` uniformly
    and independently: an expert escapes one row with probability ``1 - k / E``."""
    return n_experts * (1 - (1 - top_k / n_experts) ** rows)


def row_chunks(rows: int, chunk: int) -> int:
    """Calls of a step chunked every ``chunk`` rows (one call at or below it)."""
    return max(1, math.ceil(rows / chunk))


def expert_bytes(args: ModelArgs, f: WeightFormats) -> int:
    """One routed expert's ``w13 [2 inter, dim]`` and ``w2 [dim, inter]``."""
    inter = args.moe_inter_dim
    return f.experts.matrix_bytes(2 * inter, args.dim) + f.experts.matrix_bytes(args.dim, inter)


def routed_expert_bytes(args: ModelArgs, rows: int, f: WeightFormats,
                        distinct: int | None = None) -> int:
    """The routed experts one MoE call of ``rows`` rows reads: ``distinct`` experts (summed over
    its ``MOE_ROWS`` chunks) when measured, else the uniform expectation per chunk."""
    if distinct is None:
        sizes = [min(MOE_ROWS, rows - r) for r in range(0, rows, MOE_ROWS)]
        expected = sum(expected_distinct_experts(args.n_routed_experts,
                                                 args.n_activated_experts, n) for n in sizes)
        return round(expected * expert_bytes(args, f))
    return distinct * expert_bytes(args, f)


def attention_weight_bytes(args: ModelArgs, f: WeightFormats) -> int:
    """``wq_a``, ``wq_b``, ``wo_a`` (one ``[rank, group in]`` per group), ``wo_b``."""
    d, h_d = f.dense, args.n_heads * args.head_dim
    return (d.matrix_bytes(args.q_lora_rank, args.dim) + d.matrix_bytes(h_d, args.q_lora_rank)
            + args.o_groups * d.matrix_bytes(args.o_lora_rank, h_d // args.o_groups)
            + d.matrix_bytes(args.dim, args.o_groups * args.o_lora_rank))


def kv_weight_bytes(args: ModelArgs, layer: int, f: WeightFormats) -> int:
    """The window latent's ``wkv``; a KV source's compressor ``wkv`` (and ``wgate`` above ratio
    1) and, sparse, ``wk_index``."""
    d = f.dense
    total = d.matrix_bytes(args.head_dim, args.dim)
    if layer in args.kv_sources:
        projections = 1 if args.compress_ratio_for(layer) == 1 else 2
        total += projections * d.matrix_bytes(args.head_dim, args.dim)
        if args.sparse:
            total += d.matrix_bytes(args.index_head_dim, args.head_dim)
    return total


def indexer_weight_bytes(args: ModelArgs, layer: int, f: WeightFormats) -> int:
    """An index source's ``wq_index`` and ``w_index``; S's publications also project their own
    query latent (``wq_a``)."""
    if args.index_source_for(layer) != layer:
        return 0
    d = f.dense
    total = (d.matrix_bytes(args.index_n_heads * args.index_head_dim, args.q_lora_rank)
             + d.matrix_bytes(args.index_n_heads, args.dim))
    if layer == args.last_kv_source:
        total += d.matrix_bytes(args.q_lora_rank, args.dim)
    return total


def mix_weight_bytes(args: ModelArgs, rows: int) -> int:
    """A block's two mHC projections ``hc_{attn,ffn}_fn`` (fp32), once per ``HC_ROWS`` chunk."""
    hc = args.hc_mult
    if hc == 1:
        return 0
    return 2 * row_chunks(rows, HC_ROWS) * FP32.matrix_bytes((2 + hc) * hc, hc * args.dim)


def moe_dense_bytes(args: ModelArgs, rows: int, f: WeightFormats) -> int:
    """The gate (once per ``MOE_ROWS`` chunk) and the shared experts (once)."""
    d, shared = f.dense, args.n_shared_experts * args.moe_inter_dim
    total = row_chunks(rows, MOE_ROWS) * d.matrix_bytes(args.n_routed_experts, args.dim)
    if shared:
        total += d.matrix_bytes(2 * shared, args.dim) + d.matrix_bytes(args.dim, shared)
    return total


def engram_cols(args: ModelArgs) -> int:
    """Table rows one row of an Engram layer fetches (n-gram sizes x hashes)."""
    return (args.engram_max_ngram_size - 1) * args.engram_n_heads


def engram_weight_bytes(args: ModelArgs, rows: int, f: WeightFormats) -> int:
    """An Engram layer's ``wkv`` (the fetched rows to hc keys + one value), per chunk."""
    width = engram_cols(args) * args.engram_head_dim
    return row_chunks(rows, ENGRAM_ROWS) * f.dense.matrix_bytes(
        args.dim * (args.hc_mult + 1), width)


def attention_kv_read_bytes(
    args: ModelArgs, layer: int, rows: QueryRows, f: WeightFormats,
    device: torch.device | str = "cpu",
) -> int:
    """One request's keys in ``layer``, each distinct key once: its window's (the ring's last
    ``min(first, W - 1)`` positions and its own rows' latents), its selected positions (sparse:
    at most ``q x top-k``, at most every visible one) or, dense, each chunk's visible global
    keys (one GEMM operand a chunk, as ``flop_model.attention_core_flops`` chunks)."""
    window = min(rows.first, args.window - 1) + rows.q_len
    total = f.window_kv.matrix_bytes(window, args.head_dim)
    ratio = args.compress_ratio_for(layer)
    if ratio is None:
        return total
    n_glob = rows.seq_len // ratio
    if args.index_source_for(layer) is not None:
        selected = min(rows.q_len * args.index_topk, n_glob)
        return total + f.compressed_kv.matrix_bytes(selected, args.head_dim)
    chunk = varlen_chunk_rows(rows.q_len, n_glob, args.n_heads, args.window, device)
    for _, last in chunks(rows, chunk):
        total += f.compressed_kv.matrix_bytes(visible_counts(last - 1, rows.seq_len, ratio),
                                              args.head_dim)
    return total


def index_key_read_bytes(
    args: ModelArgs, layer: int, rows: QueryRows, f: WeightFormats,
    device: torch.device | str = "cpu", kernels: Kernels = TORCH_KERNELS,
) -> int:
    """An index source's keys, once per chunk of one request's rows: those up to the chunk's
    last visible one (chunked as ``flop_model.indexer_flops``)."""
    if args.index_source_for(layer) != layer:
        return 0
    ratio = args.compress_ratio_for(layer)
    n_keys = rows.seq_len // ratio
    chunk = index_chunk_rows(n_keys, args.index_n_heads, device, kernels.triton)
    return sum(f.index_keys.matrix_bytes(visible_counts(last - 1, rows.seq_len, ratio),
                                         args.index_head_dim)
               for _, last in chunks(rows, chunk))


def completed_groups(rows: QueryRows, ratio: int) -> int:
    """Groups of ``ratio`` positions whose last position is one of these rows."""
    return rows.seq_len // ratio - rows.first // ratio


def ring_write_bytes(args: ModelArgs, rows: Sequence[QueryRows], f: WeightFormats) -> int:
    """Each request's last ``min(q, W)`` rows into a window ring."""
    return sum(f.window_kv.matrix_bytes(min(r.q_len, args.window), args.head_dim) for r in rows)


def source_write_bytes(args: ModelArgs, layer: int, rows: Sequence[QueryRows],
                       f: WeightFormats) -> int:
    """A KV source's compressed KV and (sparse) index keys of the groups the step completes."""
    if layer not in args.kv_sources:
        return 0
    ratio = args.compress_ratio_for(layer)
    groups = sum(completed_groups(r, ratio) for r in rows)
    total = f.compressed_kv.matrix_bytes(groups, args.head_dim)
    if args.sparse:
        total += f.index_keys.matrix_bytes(groups, args.index_head_dim)
    return total


def stream_bytes(args: ModelArgs, rows: int, f: WeightFormats) -> int:
    """``rows`` rows of mHC streams (``hc_mult`` of ``dim``) and their fp32 pre-mix."""
    return (args.hc_mult * f.activations.matrix_bytes(rows, args.dim)
            + FP32.matrix_bytes(rows, args.hc_mult))


def layer_bytes(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
    formats: WeightFormats | None = None,
    distinct_experts: Mapping[int, int] | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes of an eager step by entry and part: ``"embed"``, ``"0"`` .. ``"n_layers - 1"``,
    ``"dspark"``, ``"head"`` (the entries of ``flop_model.layer_flops``, with the embedding
    first). ``formats`` defaults to fp32 everywhere; ``distinct_experts`` maps a layer to the
    routed experts it measured touching (missing layers: the uniform expectation)."""
    f = formats or WeightFormats.of_dtype(torch.float32)
    measured = distinct_experts or {}
    s = args.last_kv_source
    whole, kept = whole_and_kept(requests, kept_lens)
    num_all, num_kept = sum(r.q_len for r in whole), sum(r.q_len for r in kept)
    out: dict[str, dict[str, int]] = {}
    out["embed"] = {**dict.fromkeys(PARTS, 0),
                    "gathers": f.dense.matrix_bytes(num_all, args.dim)}
    for layer in range(args.n_layers):
        parts = dict.fromkeys(PARTS, 0)
        rows = whole if layer < s else kept
        n = num_all if layer < s else num_kept
        writers = whole if layer <= s else kept  # S's batch KV is written from every row
        parts["weights"] = (attention_weight_bytes(args, f) + kv_weight_bytes(args, layer, f)
                            + indexer_weight_bytes(args, layer, f) + mix_weight_bytes(args, n)
                            + moe_dense_bytes(args, n, f))
        parts["experts"] = routed_expert_bytes(args, n, f, measured.get(layer))
        parts["kv_read"] = sum(attention_kv_read_bytes(args, layer, r, f, device) for r in rows)
        indexed = whole if layer <= s else kept
        parts["kv_read"] += sum(index_key_read_bytes(args, layer, r, f, device, kernels)
                                for r in indexed)
        parts["kv_write"] = (ring_write_bytes(args, rows, f)
                             + source_write_bytes(args, layer, writers, f))
        parts["activations"] = 2 * stream_bytes(args, n, f)
        if layer == s:  # its attention input and batch KV from every row's streams
            parts["activations"] += stream_bytes(args, num_all, f)
        if layer in args.engram_layers:
            parts["weights"] += engram_weight_bytes(args, num_all, f)
            parts["gathers"] = f.dense.matrix_bytes(num_all * engram_cols(args),
                                                    args.engram_head_dim)
            parts["activations"] += 2 * args.hc_mult * f.activations.matrix_bytes(num_all,
                                                                                   args.dim)
        out[str(layer)] = parts
    out["dspark"] = dspark_bytes(args, kept, f)
    num_logits = sum(r.query_len if r.every_row_logits else 1 for r in requests)
    out["head"] = {**dict.fromkeys(PARTS, 0),
                   "weights": f.head.matrix_bytes(args.vocab_size, args.dim),
                   "activations": stream_bytes(args, num_logits, f)
                   + FP32.matrix_bytes(num_logits, args.vocab_size)}
    return out


def dspark_bytes(args: ModelArgs, kept: Sequence[QueryRows], f: WeightFormats) -> dict[str, int]:
    """The draft rings' seeding on the kept rows: ``main_proj`` and each draft layer's ``wkv``,
    the targets' aux hidden states read, each ring written."""
    parts = dict.fromkeys(PARTS, 0)
    if not args.dspark_layers:
        return parts
    n, targets = sum(r.q_len for r in kept), len(args.dspark_target_layers)
    parts["weights"] = (f.dense.matrix_bytes(args.dim, targets * args.dim)
                        + args.dspark_layers * f.dense.matrix_bytes(args.head_dim, args.dim))
    parts["activations"] = f.activations.matrix_bytes(n, targets * args.dim)
    parts["kv_write"] = args.dspark_layers * ring_write_bytes(args, kept, f)
    return parts


def step_bytes(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
    formats: WeightFormats | None = None,
    distinct_experts: Mapping[int, int] | None = None,
) -> dict[str, int]:
    """``layer_bytes`` summed by part, and ``total``."""
    return sum_by_part(layer_bytes(args, requests, kept_lens, device, kernels, formats,
                                   distinct_experts), PARTS)


@dataclass(frozen=True)
class LayerCost:
    """What one entry of a step must do: its FLOPs and the bytes it moves."""

    flops: int
    bytes: int


def step_costs(
    args: ModelArgs,
    requests: Sequence[RequestSpec],
    kept_lens: Sequence[int],
    device: torch.device | str = "cpu",
    kernels: Kernels = TORCH_KERNELS,
    formats: WeightFormats | None = None,
    distinct_experts: Mapping[int, int] | None = None,
) -> dict[str, LayerCost]:
    """Each entry's analytic FLOPs (``flop_model.layer_flops``) and bytes (``layer_bytes``)."""
    flops = layer_flops(args, requests, kept_lens, device, kernels)
    moved = layer_bytes(args, requests, kept_lens, device, kernels, formats, distinct_experts)
    return {name: LayerCost(sum(flops.get(name, {}).values()), sum(moved[name].values()))
            for name in moved}
