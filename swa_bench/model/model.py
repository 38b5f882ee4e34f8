"""A DeepSeek-V4.1-style layer stack in plain PyTorch, readable top to bottom.

    tokens -> embedding -> mHC streams
      -> window-only layers (window ring); Engram before its layers (n-gram lookups, every row)
      -> encoder layers (window ring + compressed KV of the closest KV source)
      -> layer S: batch KV (window KV, compressor KV, indexer publications: every row) | the rest
      -> decoder layers (window ring + S's global KV)          } the replay layers
      -> DSpark draft rings, from the target layers' inputs      }
      -> head on the logits rows

Every attention block attends to [its window KV] + [the global/compressed KV visible at the row],
one softmax with a per-head sink. K and V are one shared latent (MQA) with partial RoPE. A layer's
input is ``hc_mult`` residual streams (mHC), a tuple of tensors, and the pre-mix its attention
collapses them with (the previous layer's, DeepSeek-V4.1's delayed pre-mix). Layers read
per-step metadata, the KV cache and the replay route from the forward context only, so the same
code runs eagerly, in graph segments and in the replay batch, and the model holds no per-engine
state: many engines (and the oracle) share one model, each forward on the cache its context
names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from swa_bench.model.args import ModelArgs
from swa_bench.model.cache import KVCache
from swa_bench.model.dspark import DSpark, aux_hidden
from swa_bench.model.engram import Engram, engram_input, step_hash_ids
from swa_bench.model.forward_context import get_forward_context
from swa_bench.model.graph_breaks import eager_break, host_effect
from swa_bench.model.hyper_connection import (
    HyperConnection,
    Mixes,
    Streams,
    add_mix_parameters,
)
from swa_bench.model.latent_attention import Attention
from swa_bench.model.moe import MoE, RoutedExperts
from swa_bench.model.norm import RMSNorm
from swa_bench.model.precision import quantise_weights

__all__ = ["Block", "ModelOutput", "ReplayInputs", "ReplayLayers", "ReplayOutputs", "Streams",
           "Transformer", "build_model", "init_weights", "materialize", "replay_layers"]

# Runs the rest of S and the decoder: (S's KV of every batch row, *per-row inputs) -> per-row
# outputs; the per-row tensors are a ``ReplayInputs`` flattened (the replay route gathers and
# scatters each one, whatever it holds).
ReplayLayers = Callable[..., tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class ReplayInputs:
    """What the replay layers read of each row, by name: the mHC streams entering layer S and the
    pre-mix S's attention collapses them with (the replay recomputes S's attention input on the
    kept rows from them), then S's publications (its indexer's top-k selection and candidate
    blocks, computed on every batch row before the cut). What comes out is a ``ReplayOutputs``.
    Flat tensors for the route (``tensors``), named again inside (``of``)."""

    streams: Streams
    pre_mix: torch.Tensor
    publications: tuple[torch.Tensor, ...] = ()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.streams, self.pre_mix, *self.publications)

    @classmethod
    def of(cls, hc: int, tensors: Sequence[torch.Tensor]) -> ReplayInputs:
        if len(tensors) < hc + 1:
            raise ValueError(f"replay inputs are {hc} streams and a pre-mix, got {len(tensors)}")
        return cls(tuple(tensors[:hc]), tensors[hc], tuple(tensors[hc + 1 :]))


@dataclass
class ReplayOutputs:
    """What the replay layers give back of each row: the final streams and the final pre-mix,
    then (with DSpark draft layers) the aux hidden states the drafter reads; scattered back to
    batch rows, zeros at trimmed rows."""

    streams: Streams
    pre_mix: torch.Tensor
    aux_hidden: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        aux = () if self.aux_hidden is None else (self.aux_hidden,)
        return (*self.streams, self.pre_mix, *aux)

    @classmethod
    def of(cls, hc: int, tensors: Sequence[torch.Tensor]) -> ReplayOutputs:
        if len(tensors) not in (hc + 1, hc + 2):
            raise ValueError(f"replay outputs are {hc} streams, a pre-mix and at most the aux "
                             f"hidden states, got {len(tensors)}")
        return cls(tuple(tensors[:hc]), tensors[hc], tensors[hc + 1] if len(tensors) > hc + 1
                   else None)


class ModelOutput(NamedTuple):
    """One forward's outputs (``Transformer.forward``)."""

    logits: torch.Tensor  # [logits rows, vocab] fp32
    streams: Streams  # the final mHC streams of every row
    pre_mix: torch.Tensor  # [rows, hc] fp32: the final pre-mix the head collapses with
    aux_hidden: torch.Tensor | None  # DSpark's aux hidden states of every row, or None


def replay_layers(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The one route to the rest of S and the decoder: the whole batch, or the context's replay
    route when the context's builder decided the step runs on kept rows. Captured inside a graph
    segment when the step has no replay batch; an eager break when it has one."""
    if get_forward_context().replay_batch is None:
        return run_layers(batch_kv, *inputs)
    return on_replay_batch(run_layers, batch_kv, *inputs)


@eager_break("replay_layers", writes_out=True)
def on_replay_batch(
    run_layers: ReplayLayers, batch_kv: torch.Tensor, *inputs: torch.Tensor,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The replay-batch route, read from the context at every call (a PIECEWISE graph replays the
    break under each step's context, so its kept rows are the step's, not the capture's); the
    outputs are scattered into ``out`` (the break's buffers) where given."""
    return get_forward_context().replay_batch.run(run_layers, batch_kv, *inputs, out=out)


class Block(nn.Module):
    """A block between two mHC sublayers (DeepSeek-V4.1 inference/model.py `Block.forward`).

    Each sublayer's ``hc_mixes`` of the streams it receives gives the post and comb it writes
    back with and the pre the *next* sublayer collapses with: attention collapses with the
    ``pre_mix`` handed in (the previous block's FFN pre), the FFN with this attention's pre, and
    the block hands its FFN pre on.
    """

    def __init__(
        self, args: ModelArgs, layer: int, experts: RoutedExperts | None = None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.hc = HyperConnection.from_args(args)
        add_mix_parameters(self, args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer)
        self.moe = MoE(args, experts)
        # Applied to the block's input streams by the stack (reference ``Block.engram``).
        self.engram = Engram(args, layer) if layer in args.engram_layers else None

    def hc_mixes(self, part: str, streams: Streams) -> Mixes | None:
        """``part``'s (attn or ffn) coefficients of ``streams``; none for one stream."""
        if self.hc.hc == 1:
            return None
        return self.hc.mixes(streams, getattr(self, f"hc_{part}_fn"),
                             getattr(self, f"hc_{part}_scale"), getattr(self, f"hc_{part}_base"))

    def attn_input(self, streams: Streams, pre_mix: torch.Tensor) -> torch.Tensor:
        return self.attn_norm(self.hc.pre(streams, pre_mix))

    def forward(
        self, streams: Streams, pre_mix: torch.Tensor, kv: torch.Tensor | None = None
    ) -> tuple[Streams, torch.Tensor]:
        """(streams, pre_mix) -> (streams, this block's FFN pre). ``kv`` is given for layer S in
        the replay layers: the batch KV it wrote for every row (``write_batch_kv``)."""
        attn_mix = self.hc_mixes("attn", streams)
        streams = self.hc.post(self.attn(self.attn_input(streams, pre_mix), kv), streams,
                               attn_mix)
        ffn_mix = self.hc_mixes("ffn", streams)
        h = self.ffn_norm(self.hc.pre(streams, pre_mix if attn_mix is None else attn_mix.pre))
        streams = self.hc.post(self.moe(h), streams, ffn_mix)
        return streams, (pre_mix if ffn_mix is None else ffn_mix.pre)

    def write_batch_kv(self, streams: Streams, pre_mix: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer S's part that runs on every row: its attention input and its KV of every row."""
        x = self.attn_input(streams, pre_mix)
        return x, self.attn.project_kv(x)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.hc = HyperConnection.from_args(args)
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        pools = args.expert_weight_pools
        self.expert_pools = nn.ModuleList(RoutedExperts(args) for _ in range(pools or 0))
        self.layers = nn.ModuleList(
            Block(args, i, self.expert_pools[i % pools] if pools else None)
            for i in range(args.n_layers)
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.dspark = DSpark(args) if args.dspark_layers else None

    @property
    def last_kv_source(self) -> Block:
        return self.layers[self.args.last_kv_source]

    def forward(self, input_ids: torch.Tensor) -> ModelOutput:
        """Logits at the context's logits rows, the final streams and the final pre-mix of every
        row (`Transformer.forward`: the embedding as ``hc_mult`` streams, a one-hot pre-mix;
        Engram's lookup added to the input streams of its layers, S's included), and the DSpark
        aux hidden states of every row (None without draft layers). Rows the replay trimmed hold
        zeros."""
        x = self.embed(input_ids)
        streams: Streams = (x,) * self.args.hc_mult  # read-only: the first post makes new ones
        pre_mix = self.hc.identity_pre_mix(x)
        hashes = step_hash_ids(input_ids, self.args) if self.args.engram_layers else None
        for block in self.layers[: self.args.last_kv_source]:
            streams, pre_mix = block(engram_input(block.engram, streams, hashes), pre_mix)
        streams = engram_input(self.last_kv_source.engram, streams, hashes)
        x_s, kv_s = self.last_kv_source.write_batch_kv(streams, pre_mix)
        published = self.publications(x_s)
        out = replay_layers(self.run_replay_layers, kv_s,
                            *ReplayInputs(streams, pre_mix, published).tensors())
        final = ReplayOutputs.of(self.args.hc_mult, out)
        return ModelOutput(self.compute_logits(final.streams, final.pre_mix), final.streams,
                           final.pre_mix, final.aux_hidden)

    def publications(self, x_s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """S's indexer on every row, part of its batch-KV work: its top-k selection and, with
        two-level candidates, its candidate blocks (none for a dense model). Per-row inputs of
        the replay route, after the streams and the pre-mix."""
        if not self.last_kv_source.attn.indexes_before_cut:
            return ()
        return self.last_kv_source.attn.publish_selection(x_s)

    def run_replay_layers(self, kv_s: torch.Tensor, *inputs: torch.Tensor
                          ) -> tuple[torch.Tensor, ...]:
        """The rest of S and the decoder on the rows given (the batch, or the replay batch):
        ``kv_s`` is S's KV of every batch row, ``inputs`` a flat ``ReplayInputs`` of these rows;
        S's attention input is computed again here from them, and S's publications are read by
        the layers from the context. Returns the flat ``ReplayOutputs`` of these rows: the final
        streams and pre-mix, then (with DSpark) the aux hidden states, after seeding the draft
        rings from them."""
        rows = ReplayInputs.of(self.args.hc_mult, inputs)
        self.receive_publications(rows.publications)
        streams, pre_mix = self.last_kv_source(rows.streams, rows.pre_mix, kv_s)
        targets, aux = self.args.dspark_target_layers, []
        for block in self.layers[self.args.last_kv_source + 1 :]:
            if block.layer in targets:  # the draft layers read the target's input streams
                aux.append(aux_hidden(streams))
            streams, pre_mix = block(streams, pre_mix)
        if self.dspark is None:
            return ReplayOutputs(streams, pre_mix).tensors()
        main_hidden = torch.cat(aux, dim=-1)
        self.dspark.seed_rings(main_hidden)
        return ReplayOutputs(streams, pre_mix, main_hidden).tensors()

    @host_effect("publications")
    def receive_publications(self, published: tuple[torch.Tensor, ...]) -> None:
        """S's publications of these rows into the current context, for S and the layers after.
        A host effect: a replay graph of these layers redoes it on each replay's context."""
        if not published:
            return
        ctx = get_forward_context()
        ctx.index_selection[self.args.last_kv_source] = published[0]
        ctx.candidates = published[1] if len(published) > 1 else None

    def compute_logits(self, streams: Streams, pre_mix: torch.Tensor) -> torch.Tensor:
        """The logits rows' streams collapsed with the final pre-mix, normed, then the head in
        fp32 (`ParallelHead`: the weight applied to ``x.float()``)."""
        rows = get_forward_context().logits_indices
        picked = tuple(s.index_select(0, rows) for s in streams)
        h = self.norm(self.hc.pre(picked, pre_mix.index_select(0, rows)))
        return F.linear(h.float(), self.head.weight.float())


FP32_PARAMETERS = ("head.weight",)  # `ParallelHead`: the logits come out in fp32 directly


def keeps_fp32(name: str) -> bool:
    """Whether the reference keeps parameter ``name`` fp32 in a model of any dtype (the head's,
    mHC's ``hc_*``)."""
    return name in FP32_PARAMETERS or name.rsplit(".", 1)[-1].startswith("hc_")


# The aux-free routing bias: a few times smaller than the spread of the seeded scores (about 0.3),
# so it changes some choices, not most.
GATE_BIAS_STD = 0.1


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
            if name.endswith(("sink", "_base", "_scale")):
                p.mul_(0.5)
            elif name.endswith("moe.gate.bias"):
                p.mul_(GATE_BIAS_STD)
            elif not name.endswith("embed.weight"):  # the embedding and Engram's tables
                fan_in = p.shape[-2] if name.endswith("wo_a") else p.shape[-1]
                p.mul_(1 / math.sqrt(fan_in))


def materialize(model: Transformer, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A meta-device model allocated on ``device`` in ``dtype``, but for the parameters the
    reference keeps fp32 in any dtype (mHC's, the head's): no fp32 copy of the rest is made."""
    model = model.to(dtype)
    for name, p in model.named_parameters():
        if keeps_fp32(name):
            p.data = p.data.float()
    return model.to_empty(device=device)


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
    model = materialize(model, dtype, device)
    init_weights(model, seed)
    quantise_weights(model)
    model.eval().requires_grad_(False)
    return model, KVCache(args, device, dtype)
