"""The step runner: one model, one cache, one configuration (replay policy and graph mode).

``Engine.step`` is what a serving engine's model runner does per step: plan the step once
(``dispatch.plan_step``: graph or eager, whole batch or replay batch), pack the requests, build the
forward context the plan calls for, and run it eagerly or through the captured graph of its padded
size. The reference paths (full batch, bounded reference) are eager runs of the same model with
different metadata.

Many engines share one model; each owns its cache and binds it in every forward context it builds
(and its graphs are captured under that context), so no engine computes on another's cache and
nothing on the model changes between engines. Which kernels run is resolved once, at
construction, for the engine's device (``Engine.kernels``) and carried in every forward context
it builds the same way: its graphs capture them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swa_bench.engine.config import EngineConfig, resolve_kernels
from swa_bench.engine.dispatch import AgreedRoute, StepPlan, plan_step, policy_kept_lens
from swa_bench.graphs.capture import CapturedGraphs
from swa_bench.graphs.replay_graphs import ReplayGraphs
from swa_bench.kernels.config import Kernels
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, StepBatch, build_step
from swa_bench.model.cache import KVCache
from swa_bench.model.forward_context import (
    ForwardContext,
    RegionTimer,
    region,
    set_forward_context,
)
from swa_bench.model.hyper_connection import Streams
from swa_bench.model.model import Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.replay.replay_batch import ReplayBatch, build_replay_batch


@dataclass
class StepOutput:
    # After a graph replay both are views of the graph's static outputs, valid until this engine's
    # next step (a serving engine reads them before the next step; no copy on the hot path).
    logits: torch.Tensor  # [logits rows, vocab] in StepBatch.logit_rows() order
    streams: Streams  # final mHC streams of the real rows (zeros at rows replay trimmed)
    pre_mix: torch.Tensor  # [rows, hc_mult] fp32: the final pre-mix the head collapses with
    step: StepBatch
    plan: StepPlan
    replay_batch: ReplayBatch | None
    # The forward's context, kept only by ``reference_step`` (the checks read its selections).
    context: ForwardContext | None = None
    # DSpark's aux hidden states of the real rows (zeros at rows replay trimmed); None without
    # draft layers.
    aux_hidden: torch.Tensor | None = None

    @classmethod
    def unpadded(
        cls, logits: torch.Tensor, streams: Streams, pre_mix: torch.Tensor,
        aux_hidden: torch.Tensor | None, step: StepBatch, plan: StepPlan,
        replay_batch: ReplayBatch | None,
    ) -> StepOutput:
        """The real rows of a padded forward's outputs (views: no copy)."""
        return cls(logits[: step.num_logits], tuple(s[: step.num_tokens] for s in streams),
                   pre_mix[: step.num_tokens], step, plan, replay_batch,
                   aux_hidden=None if aux_hidden is None else aux_hidden[: step.num_tokens])


def run_forward(model: Transformer, step: StepBatch, ctx: ForwardContext):
    with torch.inference_mode(), set_forward_context(ctx):
        return model(step.input_ids)


class Engine:
    """One engine owns one cache, made here and never shared (the checks copy between caches,
    ``KVCache.copy_from``). ``agree`` (data parallel) turns this rank's plan of a step into the
    route every rank agreed (``swa_bench.parallel.agreement``); every rank must then plan the
    same steps."""

    def __init__(
        self, model: Transformer, config: EngineConfig | None = None,
        *, agree: Callable[[StepPlan], AgreedRoute] | None = None,
    ) -> None:
        self.model = model
        self.agree = agree
        self.args: ModelArgs = model.args
        self.config = (config if config is not None
                       else EngineConfig.for_model(self.args)).check(self.args.window)
        self.device = model.embed.weight.device
        self.kernels: Kernels = resolve_kernels(self.config.kernels, self.device.type)
        dtype = model.embed.weight.dtype
        self.cache = KVCache(self.args, self.device, dtype)
        self.logit_slots = self.args.max_requests
        self.graphs: CapturedGraphs | None = None
        if self.config.graph_mode != "eager":
            self.graphs = CapturedGraphs(
                model, self.config.graph_mode, self.config.capture_sizes, self.logit_slots,
                self.cache,
            )
        # Replay batches' graphs (PIECEWISE), in the model graphs' memory pool; captured at the
        # first step that runs one.
        self.replay_graphs: ReplayGraphs | None = None
        if self.config.replay_capture_sizes:
            self.replay_graphs = ReplayGraphs(
                self.args, self.config.replay_capture_sizes, self.cache, self.kernels,
                self.device, self.graphs.pool,
            )

    def plan(
        self, requests: Sequence[RequestSpec], *, capture_size: int | None = None
    ) -> StepPlan:
        plan = plan_step(requests, self.config, self.args, capture_size=capture_size)
        if self.agree is None or capture_size is not None:
            return plan
        return plan_step(requests, self.config, self.args, agreed=self.agree(plan))

    def capture(self) -> None:
        if self.graphs is not None and not self.graphs.captured:
            self.graphs.capture_all(
                lambda static, size: self.forward_context(
                    static, self.plan(static.requests, capture_size=size), self.cache
                )
            )

    def prepare(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        pad_to: int | None = None,
    ) -> StepBatch:
        indices = list(range(len(requests))) if cache_indices is None else list(cache_indices)
        return build_step(
            requests,
            tokens,
            indices,
            self.args,
            self.device,
            pad_to=pad_to,
            logit_slots=None if pad_to is None else self.logit_slots,
        )

    def forward_context(
        self, step: StepBatch, plan: StepPlan, cache: KVCache, timer: RegionTimer | None = None,
        *, eager: bool = False,
    ) -> ForwardContext:
        """The context ``plan`` calls for on ``cache``: its replay batch (or none, padded to the
        plan's replay graph size, running in that graph unless ``eager``) and its shape mode.
        ``cache`` is this engine's but for ``eager_equivalent(on=)``, which runs eagerly."""
        replay_batch = None
        if plan.replays:
            with region(timer, "prepare"):
                replay_batch = build_replay_batch(step, plan.kept_lens, self.args, cache,
                                                  self.kernels, pad_to=plan.replay_graph_size,
                                                  floors=plan.decoder_floors)
            if plan.replay_graph_size is not None and not eager:
                replay_batch.run_graph = self.replay_graphs.run
        return ForwardContext(
            attn_metadata=step.metadata,
            logits_indices=step.logits_indices,
            cache=cache,
            kernels=self.kernels,
            shape_mode=plan.shape_mode,
            replay_batch=replay_batch,
            timer=timer,
        )

    def step(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        timer: RegionTimer | None = None,
    ) -> StepOutput:
        plan = self.plan(requests)
        if plan.graph_size is None:
            step = self.prepare(requests, tokens, cache_indices)
            ctx = self.forward_context(step, plan, self.cache, timer)
            logits, streams, pre_mix, aux = run_forward(self.model, step, ctx)
            return StepOutput(logits, streams, pre_mix, step, plan, ctx.replay_batch,
                              aux_hidden=aux)
        self.capture()
        padded = self.prepare(requests, tokens, cache_indices, pad_to=plan.graph_size)
        step = self.graphs.load(padded, plan.graph_size)
        ctx = self.forward_context(step, plan, self.cache, timer)
        logits, streams, pre_mix, aux = self.graphs.run(plan.graph_size, ctx)
        return StepOutput.unpadded(logits, streams, pre_mix, aux, step, plan, ctx.replay_batch)

    def eager_equivalent(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        on: Engine | None = None,
    ) -> StepOutput:
        """What ``step`` computes, run eagerly: the same plan, padded shapes (the step's and its
        replay batch's) and attention kernel, on ``on``'s cache (default this engine's). E3
        compares graph replays with it; FLOPs are counted on it (a graph replay hides its
        kernels)."""
        target = on or self
        plan = self.plan(requests)
        step = target.prepare(requests, tokens, cache_indices, pad_to=plan.graph_size)
        ctx = self.forward_context(step, plan, target.cache, eager=True)
        logits, streams, pre_mix, aux = run_forward(target.model, step, ctx)
        return StepOutput.unpadded(logits, streams, pre_mix, aux, step, plan, ctx.replay_batch)

    def reference_step(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        layer_metadata: dict[int, AttentionMetadata] | None = None,
        given_selection: dict[int, torch.Tensor] | None = None,
        record_index_queries: bool = False,
    ) -> StepOutput:
        """The full-batch path: every layer on every row. ``layer_metadata`` overrides per-layer
        metadata (the oracle's bounded reference of SPEC E1 masks decoder windows so);
        ``given_selection`` fixes index sources' top-k (``ForwardContext.given_selection``). The
        output keeps the forward context: its selections and, if recorded, index queries."""
        step = self.prepare(requests, tokens, cache_indices)
        ctx = ForwardContext(
            attn_metadata=step.metadata,
            logits_indices=step.logits_indices,
            cache=self.cache,
            kernels=self.kernels,
            layer_metadata=dict(layer_metadata or {}),
            given_selection=dict(given_selection or {}),
            index_queries={} if record_index_queries else None,
        )
        logits, streams, pre_mix, aux = run_forward(self.model, step, ctx)
        query = tuple(r.query_len for r in requests)
        plan = StepPlan(graph_size=None, shape_mode="varlen", replays=False, kept_lens=query,
                        num_tokens=sum(query), reason="reference: every layer on every row")
        return StepOutput(logits, streams, pre_mix, step, plan, None, ctx, aux)

    def policy_kept_lens(self, requests: Sequence[RequestSpec]) -> tuple[int, ...]:
        return policy_kept_lens(requests, self.config, self.args)
