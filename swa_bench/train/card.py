"""The model card written beside a checkpoint: how it was made, its size, its figures."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from swa_bench.model.model import Transformer
from swa_bench.tasks import data
from swa_bench.train.loop import Figures, TrainConfig

CARD_SUFFIX = ".md"


def card_path(checkpoint: Path) -> Path:
    """The card beside ``checkpoint``: its name with the suffix ``.md``. A checkpoint named
    ``*.md`` would be its own card, so ``outputs.claim`` refuses one."""
    return checkpoint.with_suffix(CARD_SUFFIX)


def card_text(cfg: TrainConfig, figures: Figures, history: list[dict], seconds: float,
              path: Path, prompts: int) -> str:
    args = cfg.args
    n_params = sum(t.numel() for t in _shapes(cfg))
    every = max(1, len(history) // 8)
    points = history[::every] + ([] if (len(history) - 1) % every == 0 else history[-1:])
    curve = ", ".join(f"{h['step']}: {h['loss']:.2f}" for h in points)
    graphed = (", each step replayed as one CUDA graph"
               if cfg.graph and cfg.device.startswith("cuda") else "")
    recall = " | ".join(f"{a:.2f}" for a in figures.recall.values())
    fetched = " | ".join(f"{figures.retrieved.get(d, float('nan')):.2f}" for d in figures.recall)
    heads = " | ".join(f"d={d}" for d in figures.recall)
    warmup = ",".join(f"{n}:{k}" for n, k in cfg.length_warmup) or "none"
    phases = "".join(f"{k} steps at {n} tokens, then " for n, k in cfg.length_warmup)
    return f"""# {path.stem}: a small trained V4.1-style model

**What it is.** The `{cfg.preset}` preset trained from scratch: byte-level
(vocab {args.vocab_size}), dim {args.dim}, {args.n_layers} layers: window-only layer 0,
encoder layers
{args.kv_sources[0]}-{args.last_kv_source - 1} reading compressed KV (ratio {args.compress_ratio}),
S = {args.last_kv_source}, a decoder of {args.n_decoder_layers} layers; window W = {args.window},
sparse attention (indexer top-{args.index_topk}, index sources {args.index_source_list()}),
{args.n_routed_experts} routed experts top-{args.n_activated_experts} + {args.n_shared_experts}
shared (storage pooled x{args.expert_weight_pools}), mHC x{args.hc_mult}.
{n_params / 1e6:.2f} M parameters, trained in fp32 and stored with its matrices in bf16 (the
rest, vectors, the head and mHC's, as trained: `weights.round_for_storage`; every figure below is
the stored model's): {path.stat().st_size / 1e6 if path.exists() else n_params * 2 / 1e6:.1f} MB of
safetensors. It is not V4.1: it is V4.1's structure at a size
that trains in minutes, to show the direction and size of bounded replay's effect on a model
that has learned to use both kinds of context.

**How it was made.** `python -m swa_bench.train --seed {cfg.seed} --steps {cfg.steps} --batch
{cfg.batch} --seq-len {cfg.seq_len} --length-warmup {warmup} --lr {cfg.lr:g} --max-facts
{cfg.max_facts} --device {cfg.device}` ({seconds:.0f} s{graphed}, torch {torch.__version__},
Python {sys.version.split()[0]}). Data generated from the seed
(`swa_bench/tasks/data.py`): the Python standard library's source text, byte-level, split into
training and held-out files by a hash of the file name, with synthetic tasks written in:
associative recall (`FACT key value` far back, `QUERY key` later: needs the global KV) and
copying a pattern inside one window (needs the window KV), up to {cfg.max_facts} facts and as
many queries a sequence; answer tokens weigh {data.ANSWER_WEIGHT:g}x in the loss.
AdamW lr {cfg.lr:g} (warm-up {cfg.warmup}, cosine to a tenth), batch {cfg.batch} sequences:
{phases}the rest at {cfg.seq_len} tokens. At 64 tokens the indexer's top-k keeps every
compressed position, so recall is learned densely and the indexer learns to find the facts
before the top-k hides anything. The forward (`swa_bench/train/forward.py`) computes what a full
prefill computes, sparse selection included (a test holds it to the engine). The indexer's
top-k is not differentiable: it is trained by the KL from each index source's dense attention
over the visible global positions to the indexer's softmax (DeepSeek's signal), its inputs
detached. Routed experts have no load-balancing loss. mHC starts as a plain residual
(`start_as_plain_residual`: comb logits {cfg.residual_init:g} x I before Sinkhorn, pre gains
1/hc, post gains 1, per-row projections 0); from the seeded dummy weights' random mix, CPU ablations
learned no recall.

Loss by step: {curve}.

**Held-out figures under a full prefill** (prompts of {cfg.seq_len} tokens,
`swa_bench.train.loop.evaluate`, on the shipped held-out text `swa_bench/tasks/held_out.txt.gz`;
`python -m swa_bench.train.evaluate {path}` prints them again): the held-out loss over
{prompts} windows of {cfg.seq_len} bytes, text loss **{figures.held_out_loss:.5f} nats/byte**;
recall
accuracy by distance of the fact from the last token (chance 1/64 for a value, 1/3 for a
guess among the prompt's three facts), the share of recall answers that are some fact's value
(right or not: the facts were found), and copy accuracy (chance 1/32):

| | {heads} | copy |
| --- | {" | ".join("---" for _ in figures.recall)} | --- |
| recall | {recall} | {figures.copy:.2f} |
| some fact's value | {fetched} | |
"""


def _shapes(cfg: TrainConfig) -> list[torch.Tensor]:
    with torch.device("meta"):
        return list(Transformer(cfg.args).state_dict().values())
