"""A DeepSeek-V4.1-style layer stack in plain PyTorch, readable top to bottom.

    tokens -> embedding -> mHC streams
      -> window-only layers (window ring); Engram before its layers (n-gram lookups, every row)
      -> encoder layers (window ring + compressed KV of the closest KV source)
      -> layer S: write batch KV (its latent for every row) | the rest of S
      -> decoder layers (window ring + S's global KV)          } the replay layers
      -> DSpark draft rings, from the target layers' inputs      }
      -> head on the logits rows

Every attention block attends to [its window KV] + [the global/compressed KV visible at the row],
one softmax with a per-head sink. K and V are one shared latent (MQA) with partial RoPE. A layer's
input is ``hc_mult`` residual streams (mHC), a tuple of tensors. Layers read per-step metadata,
the KV cache and the replay route from the forward context only, so the same code runs eagerly,
in graph segments and in the replay batch, and the model holds no per-engine state: many engines
(and the oracle) share one model, each forward on the cache its context names.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from swa_bench.model.args import ModelArgs
from swa_bench.model.cache import KVCache
from swa_bench.model.dspark import DSpark, aux_hidden
from swa_bench.model.engram import Engram, engram_input, step_hash_ids
from swa_bench.model.forward_context import get_forward_context
from swa_bench.model.graph_breaks import eager_break
from swa_bench.model.hyper_connection import HyperConnection, Streams
from swa_bench.model.latent_attention import Attention
from swa_bench.model.moe import MoE, RoutedExperts
from swa_bench.model.norm import RMSNorm

__all__ = ["Block", "ReplayLayers", "Streams", "Transformer", "build_model", "init_weights",
           "replay_layers"]

# Runs the rest of S and the decoder: (S's KV of every batch row, *per-row inputs) -> streams.
ReplayLayers = Callable[..., Streams]


def replay_layers(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor
) -> Streams:
    """The one route to the rest of S and the decoder: the whole batch, or the context's replay
    route when the context's builder decided the step runs on kept rows. Captured inside a graph
    segment when the step has no replay batch; an eager break when it has one."""
    if get_forward_context().replay_batch is None:
        return run_layers(batch_kv, *inputs)
    return on_replay_batch(run_layers, batch_kv, *inputs)


@eager_break("replay_layers")
def on_replay_batch(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor
) -> Streams:
    """The replay-batch route, read from the context at every call (a PIECEWISE graph replays the
    break under each step's context, so its kept rows are the step's, not the capture's)."""
    return get_forward_context().replay_batch.run(run_layers, batch_kv, *inputs)


class Block(nn.Module):
    def __init__(
        self, args: ModelArgs, layer: int, experts: RoutedExperts | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.attn_hc, self.ffn_hc = HyperConnection(args), HyperConnection(args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.moe = MoE(args, experts)
        # Applied to the block's input streams by the stack (reference ``Block.engram``).
        self.engram = Engram(args, layer) if layer in args.engram_layers else None

    def forward(self, streams: Streams) -> Streams:
        x, post = self.attn_hc.pre(streams, self.attn_norm)
        return self.finish(streams, x, post)

    def write_batch_kv(self, streams: Streams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer S's part that runs on every row: its attention input and its KV for every row."""
        x, post = self.attn_hc.pre(streams, self.attn_norm)
        return x, post, self.attn.project_kv(x)

    def finish(
        self,
        streams: Streams,
        x: torch.Tensor,
        post: torch.Tensor | None,
        kv: torch.Tensor | None = None,
    ) -> Streams:
        streams, h, post = self.attn_hc.post_then_pre(streams, self.attn(x, kv), post,
                                                      self.ffn_hc, self.ffn_norm)
        return self.ffn_hc.post(streams, self.moe(h), post)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        pools = args.expert_weight_pools
        self.expert_pools = nn.ModuleList(RoutedExperts(args) for _ in range(pools or 0))
        self.layers = nn.ModuleList(
            Block(args, i, self.expert_pools[i % pools] if pools else None)
            for i in range(args.n_layers)
        )
        self.head_hc = nn.Parameter(torch.zeros(args.hc_mult))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.dspark = DSpark(args) if args.dspark_layers else None

    @property
    def last_kv_source(self) -> Block:
        return self.layers[self.args.last_kv_source]

    def forward(
        self, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, Streams, torch.Tensor | None]:
        """Logits at the context's logits rows, the final streams of every row, and the DSpark
        aux hidden states ``main_hidden`` of every row (None without draft layers). Rows the
        replay trimmed hold zeros in both."""
        hc = self.args.hc_mult
        x = self.embed(input_ids)
        streams: Streams = (x,) * hc  # read-only: the first post makes new ones
        hashes = step_hash_ids(input_ids, self.args) if self.args.engram_layers else None
        for block in self.layers[: self.args.last_kv_source]:
            streams = block(engram_input(block.engram, streams, hashes))
        streams = engram_input(self.last_kv_source.engram, streams, hashes)
        x_s, post_s, kv_s = self.last_kv_source.write_batch_kv(streams)
        outputs = replay_layers(self.run_replay_layers, kv_s, *streams, x_s, post_s)
        streams, aux = outputs[:hc], outputs[hc:]
        return self.compute_logits(streams), streams, (aux[0] if aux else None)

    def run_replay_layers(self, kv_s: torch.Tensor, *inputs: torch.Tensor) -> Streams:
        """The rest of S and the decoder on the rows given (the batch, or the replay batch).

        ``kv_s`` is S's KV of every batch row; the other inputs are per-row: the mHC streams,
        S's attention input and its post gains. Returns the streams, then (with DSpark) the aux
        hidden states of these rows, after seeding the draft rings from them.
        """
        hc = self.args.hc_mult
        streams, x_s, post_s = tuple(inputs[:hc]), inputs[hc], inputs[hc + 1]
        streams = self.last_kv_source.finish(streams, x_s, post_s if hc > 1 else None, kv_s)
        targets, aux = self.args.dspark_target_layers, []
        for block in self.layers[self.args.last_kv_source + 1 :]:
            if block.layer in targets:  # the draft layers read the target's input streams
                aux.append(aux_hidden(streams))
            streams = block(streams)
        if self.dspark is None:
            return streams
        main_hidden = torch.cat(aux, dim=-1)
        self.dspark.seed_rings(main_hidden)
        return (*streams, main_hidden)

    def compute_logits(self, streams: Streams) -> torch.Tensor:
        rows = get_forward_context().logits_indices
        picked = torch.stack([s.index_select(0, rows) for s in streams], dim=1)
        weights = torch.softmax(self.head_hc.float(), dim=0)
        h = (picked.float() * weights[None, :, None]).sum(dim=1).to(picked.dtype)
        return self.head(self.norm(h)).float()


def init_weights(model: Transformer, seed: int) -> None:
    """Dummy weights from a seed, drawn where the model lives (a V4.1-shape model has billions),
    scaled so activations stay near unit size at any depth."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "q_weight", "k_weight")):  # Engram's: ones
                p.fill_(1.0)
                continue
            p.normal_(generator=gen)
            if name.endswith(("sink", "res_logits", "static_pre", "static_post", "head_hc")):
                p.mul_(0.5)
            elif not name.endswith("embed.weight"):  # the embedding and Engram's tables
                fan_in = p.shape[-2] if name.endswith("wo_a") else p.shape[-1]
                p.mul_(1 / math.sqrt(fan_in))


def build_model(
    args: ModelArgs,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, KVCache]:
    """A model with seeded dummy weights, and an empty cache for it (the model holds none: the
    forward context of each forward names the cache it runs on)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)  # allocated in dtype: no fp32 copy
    init_weights(model, seed)
    model.eval().requires_grad_(False)
    return model, KVCache(args, device, dtype)
