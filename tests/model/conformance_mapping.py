"""The conformance fixture (tests/fixtures/conformance/v41-tiny, CARD.md) read into swa-bench's
terms: its reference config as swa-bench ``ModelArgs``, the reference's state_dict as swa-bench's
parameters, the swa-bench run it is compared with, and the swa-bench caches beside the
reference's ones.

The fixture was produced by DeepSeek-V4.1's own inference code (inference/model.py of the
V4.1-Flash release, revision dba1be0a, run from tenstorrent/tt-metal's public copy) in fp32; this
module only renames and re-lays tensors, it computes nothing of the model. Every place where a
swa-bench name or layout is assumed is here, one function each, so a rename lands in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from swa_bench.model.args import MODEL_FIELDS, ModelArgs

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conformance" / "v41-tiny"
DSPARK_PREFIX = "dspark.mtp"  # swa-bench's DSpark draft layers (reference: mtp)


@dataclass(frozen=True)
class Fixture:
    config: dict  # the reference ModelArgs, its field names
    weights: dict[str, torch.Tensor]  # the reference state_dict, fp32 (stored bf16-exact)
    expected: dict[str, torch.Tensor]  # inputs and every recorded tensor (CARD.md)

    @property
    def prompt(self) -> torch.Tensor:
        return self.expected["prompt"]  # [B, P]

    @property
    def decode_tokens(self) -> torch.Tensor:
        return self.expected["decode_tokens"][:, :-1]  # [B, steps]: the last only fed the drafts


def read_bf16_weights(path: Path) -> dict[str, torch.Tensor]:
    """The fp32 fixture's weights: bf16-exact values stored as bf16, read back as fp32."""
    return {k: v.float() for k, v in load_file(str(path)).items()}


def load_fixture(path: Path = FIXTURE, read_weights=read_bf16_weights) -> Fixture:
    """``read_weights(weights.safetensors)`` gives the reference state_dict as fp32 values (the fp8
    fixture passes its dequantiser, conformance_fp8.dequantise)."""
    return Fixture(json.loads((path / "config.json").read_text()),
                   read_weights(path / "weights.safetensors"),
                   load_file(str(path / "expected.safetensors")))


# ---- the config ---------------------------------------------------------------------------------


@dataclass
class ArgsMapping:
    args: ModelArgs | None
    missing: list[str] = field(default_factory=list)  # "swa_field (reference field = value)"


def swa_bench_args(ref: dict) -> ArgsMapping:
    """The reference config as swa-bench ``ModelArgs``, field by field:

    * same name: vocab_size, dim, n_layers, n_heads, head_dim, q_lora_rank, o_groups,
      o_lora_rank, n_routed_experts, n_activated_experts, n_shared_experts, moe_inter_dim,
      hc_mult, hc_sinkhorn_iters, hc_eps, index_topk, index_n_heads, index_head_dim, rope_theta,
      compress_rope_theta, original_seq_len, rope_factor, beta_fast, beta_slow, route_scale,
      swiglu_limit, norm_eps, max_seq_len, candidate_topk_blocks, candidate_block_size,
      engram_max_ngram_size, engram_n_heads, engram_head_dim, engram_vocab_size, engram_pad_id;
    * renamed: rope_dim = rope_head_dim, window = window_size, kv_sources = kv_source_layers,
      index_sources = index_source_layers, max_requests = max_batch_size, engram_layers =
      engram_layer_ids, dspark_layers = n_mtp_layers, dspark_target_layers =
      dspark_target_layer_ids, dspark_n_routed_experts / dspark_n_activated_experts;
    * derived: compress_ratio = the encoder's ratio of compress_ratios (swa-bench derives the
      per-layer list from kv_sources: checked equal); the candidate source is S (checked);
      engram_num_embeddings = swa-bench's ``engram_table_rows`` (the summed primes: checked);
    * fixed in swa-bench (checked at the reference's value): score_func sqrtsoftplus,
      gate_temp 1, norm_topk_prob, one shared expert, no vision; the Engram compressed vocab is
      the identity map (CARD.md), so engram_compressed_vocab_size must equal vocab_size unless
      swa-bench has the field.

    The DSpark draft block's own sizes (dspark_block_size, dspark_markov_rank,
    dspark_noise_token_id) are passed only where swa-bench has the field: it seeds the draft
    rings and does not run the draft block. Every other field swa-bench lacks is ``missing``.
    """
    n = ref["n_layers"]
    ratios = list(ref["compress_ratios"])
    encoder = sorted({r for r in ratios[:n] if r > 1})
    assert len(encoder) <= 1, f"swa-bench has one encoder ratio, the reference {encoder}"
    assert ref["score_func"] == "sqrtsoftplus" and ref["gate_temp"] == 1.0
    assert ref["norm_topk_prob"] and ref["n_shared_experts"] == 1 and ref["vision_n_layers"] == 0
    assert ref["candidate_source_layer"] in (-1, ref["kv_source_layers"][-1]), \
        "swa-bench's candidate source is S, the last KV source"
    candidates = ref["candidate_source_layer"] >= 0
    wanted = {
        "vocab_size": ref["vocab_size"], "dim": ref["dim"], "n_layers": n,
        "n_heads": ref["n_heads"], "head_dim": ref["head_dim"], "rope_dim": ref["rope_head_dim"],
        "q_lora_rank": ref["q_lora_rank"], "o_groups": ref["o_groups"],
        "o_lora_rank": ref["o_lora_rank"], "window": ref["window_size"],
        "kv_sources": list(ref["kv_source_layers"]),
        "compress_ratio": encoder[0] if encoder else 2,
        "n_routed_experts": ref["n_routed_experts"],
        "n_activated_experts": ref["n_activated_experts"],
        "n_shared_experts": ref["n_shared_experts"], "moe_inter_dim": ref["moe_inter_dim"],
        "hc_mult": ref["hc_mult"], "hc_sinkhorn_iters": ref["hc_sinkhorn_iters"],
        "hc_eps": ref["hc_eps"], "index_topk": ref["index_topk"],
        "index_n_heads": ref["index_n_heads"], "index_head_dim": ref["index_head_dim"],
        "index_sources": list(ref["index_source_layers"]), "expert_weight_pools": None,
        "rope_theta": float(ref["rope_theta"]),
        "compress_rope_theta": float(ref["compress_rope_theta"]),
        "original_seq_len": ref["original_seq_len"], "rope_factor": float(ref["rope_factor"]),
        "beta_fast": ref["beta_fast"], "beta_slow": ref["beta_slow"],
        "route_scale": ref["route_scale"], "swiglu_limit": ref["swiglu_limit"],
        "norm_eps": ref["norm_eps"], "max_seq_len": ref["max_seq_len"],
        "max_requests": ref["max_batch_size"],
        "candidate_topk_blocks": ref["candidate_topk_blocks"] if candidates else None,
        "candidate_block_size": ref["candidate_block_size"] if candidates else 8,
        "engram_layers": list(ref["engram_layer_ids"]),
        "engram_max_ngram_size": ref["engram_max_ngram_size"],
        "engram_n_heads": ref["engram_n_heads"], "engram_head_dim": ref["engram_head_dim"],
        "engram_vocab_size": ref["engram_vocab_size"],
        "engram_pad_id": ref["engram_pad_id"],
        "dspark_layers": ref["n_mtp_layers"] if ref["dspark_block_size"] else 0,
        "dspark_target_layers": list(ref["dspark_target_layer_ids"]),
        "dspark_n_routed_experts": ref["dspark_n_routed_experts"],
        "dspark_n_activated_experts": ref["dspark_n_activated_experts"],
    }
    optional = {
        "engram_compressed_vocab_size": ref["engram_compressed_vocab_size"],
        "dspark_block_size": ref["dspark_block_size"],
        "dspark_markov_rank": ref["dspark_markov_rank"],
        "dspark_noise_token_id": ref["dspark_noise_token_id"],
    }
    assert "engram_compressed_vocab_size" in MODEL_FIELDS or (
        ref["engram_compressed_vocab_size"] == ref["vocab_size"]), "identity token map only"
    missing = [f"{k} (= {v!r})" for k, v in wanted.items() if k not in MODEL_FIELDS]
    present = {k: v for k, v in {**wanted, **optional}.items() if k in MODEL_FIELDS}
    args = ModelArgs(**present)
    if getattr(args, "engram_layers", None):
        rows = list(args.engram_table_rows)
        if rows != list(ref["engram_num_embeddings"]):
            missing.append(f"engram table rows {rows} (= {ref['engram_num_embeddings']!r})")
    derived = [args.compress_ratio_for(i) or 0 for i in range(n)]
    assert derived == ratios[:n], f"compress_ratios {ratios[:n]} != swa-bench's {derived}"
    assert all(r == 0 for r in ratios[n:]), "DSpark draft layers are window-only"
    return ArgsMapping(args, missing)


# ---- the weights --------------------------------------------------------------------------------


def map_reference_weights(ref: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The reference state_dict under swa-bench's parameter names, name by name:

    * embed.weight, norm.weight, head.weight: same;
    * layers.i.{attn_norm, ffn_norm}.weight, layers.i.hc_{attn,ffn}_{fn,base,scale}: same;
    * layers.i.attn.{wq_a, q_norm, wq_b, wkv, kv_norm, wo_b}.weight: same;
    * layers.i.attn.wo_a.weight ``[groups * o_lora_rank, group_in]`` (the reference views it
      as ``[groups, o_lora_rank, group_in]``) -> layers.i.attn.wo_a
      ``[groups, group_in, o_lora_rank]``;
    * layers.i.attn.attn_sink -> layers.i.attn.sink;
    * layers.i.attn.compressor.{wkv, wgate, norm}.weight: same;
    * layers.i.attn.indexer.wq_b -> attn.wq_index, .weights_proj -> attn.w_index,
      .wk -> attn.wk_index, .k_norm -> attn.index_norm;
    * layers.i.ffn.gate.{weight, bias} -> layers.i.moe.gate.{weight, bias};
    * layers.i.ffn.experts.e.{w1, w3, w2}.weight -> layers.i.moe.own_experts.w13[e] = [w1; w3]
      (gate rows, then up rows), .w2[e] = w2;
    * layers.i.ffn.shared_experts.{w1, w3} -> layers.i.moe.shared_w13.weight = [w1; w3],
      .w2 -> layers.i.moe.shared_w2.weight;
    * layers.i.engram.{embed.weight (the fp32 table), wkv.weight, q_weight, k_weight}: same;
    * mtp.j.<block names> -> {DSPARK_PREFIX}.j.<the same rules>, main_proj / main_norm / norm /
      markov_head / confidence_head unchanged (swa-bench may keep only what seeds the rings).
    """
    groups, rank = config["o_groups"], config["o_lora_rank"]
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, t in ref.items():
        prefix, rest = split_block(name)
        if prefix is None:
            out[name] = t
            continue
        if rest == "attn.wo_a.weight":
            out[f"{prefix}.attn.wo_a"] = t.view(groups, rank, -1).transpose(1, 2).contiguous()
        elif rest == "attn.attn_sink":
            out[f"{prefix}.attn.sink"] = t
        elif rest.startswith("attn.indexer."):
            leaf = rest.removeprefix("attn.indexer.")
            renamed = {"wq_b.weight": "wq_index.weight", "weights_proj.weight": "w_index.weight",
                       "wk.weight": "wk_index.weight", "k_norm.weight": "index_norm.weight"}
            out[f"{prefix}.attn.{renamed[leaf]}"] = t
        elif rest.startswith("ffn.experts."):
            _, _, e, w, _ = rest.split(".")
            experts.setdefault((prefix, int(e)), {})[w] = t
        elif rest.startswith("ffn.shared_experts."):
            experts.setdefault((prefix, -1), {})[rest.split(".")[2]] = t
        elif rest.startswith("ffn.gate."):
            out[f"{prefix}.moe.{rest.removeprefix('ffn.')}"] = t
        else:
            out[f"{prefix}.{rest}"] = t
    routed: dict[str, tuple[list, list]] = {}
    for (prefix, e), w in sorted(experts.items()):
        w13 = torch.cat([w["w1"], w["w3"]])
        if e < 0:
            out[f"{prefix}.moe.shared_w13.weight"] = w13
            out[f"{prefix}.moe.shared_w2.weight"] = w["w2"]
        else:
            routed.setdefault(prefix, ([], []))[0].append(w13)
            routed[prefix][1].append(w["w2"])
    for prefix, (w13, w2) in routed.items():
        out[f"{prefix}.moe.own_experts.w13"] = torch.stack(w13)
        out[f"{prefix}.moe.own_experts.w2"] = torch.stack(w2)
    return out


def split_block(name: str) -> tuple[str | None, str]:
    """``layers.i.rest`` -> (``layers.i``, rest); ``mtp.j.rest`` -> (``{DSPARK_PREFIX}.j``, rest);
    a model-level name -> (None, name)."""
    parts = name.split(".")
    if parts[0] == "layers":
        return f"layers.{parts[1]}", ".".join(parts[2:])
    if parts[0] == "mtp":
        return f"{DSPARK_PREFIX}.{parts[1]}", ".".join(parts[2:])
    return None, name


@dataclass
class Loaded:
    unfilled: list[str]  # swa-bench parameters no reference tensor maps onto
    unused: list[str]  # mapped reference tensors swa-bench has no parameter for (not draft-only)
    shape_errors: list[str]


def load_reference_weights(model: torch.nn.Module, mapped: dict[str, torch.Tensor]) -> Loaded:
    """Copies ``mapped`` into ``model``'s state. Every swa-bench parameter must be filled;
    a mapped tensor may go unused only under the DSpark prefix (the draft block and heads, which
    swa-bench does not run)."""
    state = model.state_dict()
    params = dict(model.named_parameters())  # buffers (tables, caches) are not weights
    unfilled = sorted(k for k in params if k not in mapped)
    unused = sorted(k for k in mapped if k not in state and not k.startswith(DSPARK_PREFIX + "."))
    shape_errors = []
    with torch.no_grad():
        for k, p in state.items():
            if k not in mapped:
                continue
            if tuple(p.shape) != tuple(mapped[k].shape):
                shape_errors.append(f"{k}: swa-bench {list(p.shape)}, reference "
                                    f"{list(mapped[k].shape)}")
                continue
            p.copy_(mapped[k])
    return Loaded(unfilled, unused, shape_errors)


# ---- swa-bench's caches beside the reference's -------------------------------------------------


def ring(cache, layer: int, row: int) -> torch.Tensor:
    """Layer ``layer``'s window ring of request slot ``row``: ``[W, head_dim]``, slot = pos mod W
    (the reference's ``window_kv_cache[row]``, the same layout)."""
    return cache.ring_window(layer, row)


def compressed(cache, source: int, row: int, groups: int) -> torch.Tensor:
    """KV source ``source``'s first ``groups`` compressed rows (post-RoPE) of request slot
    ``row`` (the reference's ``compress_kv_cache[row, :groups]``)."""
    base = row * cache.groups(source)
    return cache.compressed[source][base : base + groups]


def index_keys(cache, source: int, row: int, groups: int) -> torch.Tensor:
    """``source``'s first ``groups`` index keys of request slot ``row`` (``indexer.k_cache``)."""
    base = row * cache.groups(source)
    return cache.index_keys[source][base : base + groups]


def group_state(cache, source: int, row: int, positions: range) -> tuple[torch.Tensor, ...]:
    """The fp32 (kv, score) of the incomplete group's ``positions`` of request slot ``row``
    (the reference's ``compressor.kv_state`` / ``score_state``, slot = pos mod ratio)."""
    ratio = cache.ratio(source)
    slots = torch.tensor([row * ratio + p % ratio for p in positions])
    state = cache.group_state[source][slots]
    return state[:, 0], state[:, 1]


def draft_ring(cache, stage: int, row: int) -> torch.Tensor:
    """DSpark draft layer ``stage``'s window ring of request slot ``row`` (the reference's
    ``mtp[stage].attn.window_kv_cache[row]``; slot = position mod W, as the layers' rings)."""
    w = cache.args.window
    return cache.draft_ring[stage][row * w : (row + 1) * w]


def main_hidden(out) -> torch.Tensor | None:
    """The DSpark aux hidden states of a step's rows (the reference's ``main_hidden``: the mean
    over streams of each target layer's input, concatenated), None where the engine gives none."""
    for name in ("aux_hidden", "main_hidden"):
        value = getattr(out, name, None)
        if value is not None:
            return value
    return None
