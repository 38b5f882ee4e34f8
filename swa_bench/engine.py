"""The step runner: one model, one cache, one graph mode and one replay policy.

``Engine.step`` is what a serving engine's model runner does per step: pack the requests, decide
whether the step uses a replay batch, and run it eagerly or through the captured graph of its
padded size. The reference paths (full batch, bounded reference) are eager runs of the same model
with different metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from swa_bench.bench.timing import region
from swa_bench.forward_context import (
    AttentionBackend,
    BatchDescriptor,
    ForwardContext,
    set_forward_context,
)
from swa_bench.graphs.capture import CapturedGraphs
from swa_bench.graphs.capture_sizes import default_capture_sizes, padded_size
from swa_bench.model.args import ModelArgs
from swa_bench.model.batch import AttentionMetadata, StepBatch, build_step
from swa_bench.model.cache import KVCache
from swa_bench.model.model import Streams, Transformer
from swa_bench.model.requests import RequestSpec
from swa_bench.replay.replay_batch import (
    ReplayBatch,
    bounded_reference_metadata,
    build_replay_batch,
)
from swa_bench.replay.row_selection import Policy

GraphModeName = Literal["eager", "piecewise", "full"]


@dataclass
class StepOutput:
    # After a graph replay both are views of the graph's static outputs, valid until this engine's
    # next step (a serving engine reads them before the next step; no copy on the hot path).
    logits: torch.Tensor  # [logits rows, vocab] in StepBatch.logit_rows() order
    streams: Streams  # final mHC streams of the real rows (zeros at rows replay trimmed)
    step: StepBatch
    replay_batch: ReplayBatch | None
    graph_size: int | None  # the capture size it replayed, None when it ran eagerly


def run_eager(
    model: Transformer,
    step: StepBatch,
    *,
    replay_batch: ReplayBatch | None = None,
    layer_metadata: dict[int, AttentionMetadata] | None = None,
    backend: AttentionBackend = "varlen",
    timer: object | None = None,
) -> tuple[torch.Tensor, Streams]:
    ctx = ForwardContext(
        attn_metadata=step.metadata,
        logits_indices=step.logits_indices,
        batch_descriptor=BatchDescriptor(step.num_padded),
        layer_metadata=layer_metadata or {},
        attention_backend=backend,
        replay_batch=replay_batch,
        timer=timer,
    )
    with torch.inference_mode(), set_forward_context(ctx):
        return model(step.input_ids)


class Engine:
    def __init__(
        self,
        model: Transformer,
        cache: KVCache | None = None,
        *,
        graph_mode: GraphModeName = "eager",
        policy: Policy = "bounded",
        trim_threshold: int | None = None,
        eager_trim_threshold: int = 0,
        capture_sizes: Sequence[int] | None = None,
        max_capture_size: int = 512,
        halo_align: int = 1,
    ) -> None:
        self.model = model
        self.args: ModelArgs = model.args
        self.device = model.embed.weight.device
        self.cache = (
            cache
            if cache is not None
            else KVCache(self.args, self.device, model.embed.weight.dtype)
        )
        self.graph_mode, self.policy, self.halo_align = graph_mode, policy, halo_align
        self.eager_trim_threshold = eager_trim_threshold
        if trim_threshold is None:
            trim_threshold = self.args.window + 1
        self.trim_threshold = trim_threshold
        self.logit_slots = self.args.max_requests
        self.graphs: CapturedGraphs | None = None
        if graph_mode != "eager":
            sizes = (
                list(capture_sizes) if capture_sizes else default_capture_sizes(max_capture_size)
            )
            self.graphs = CapturedGraphs(
                model,
                graph_mode,
                sizes,
                policy=policy,
                trim_threshold=None if policy == "full" else trim_threshold,
                logit_slots=self.logit_slots,
                halo_align=halo_align,
            )

    def capture(self) -> None:
        if self.graphs is not None and not self.graphs.graphs:
            self.model.attach_cache(self.cache)
            self.graphs.capture_all()

    def prepare(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        pad_to: int | None = None,
        logit_slots: int | None = None,
    ) -> StepBatch:
        indices = list(range(len(requests))) if cache_indices is None else list(cache_indices)
        return build_step(
            requests,
            tokens,
            indices,
            self.args,
            self.device,
            pad_to=pad_to,
            logit_slots=logit_slots,
        )

    def graph_size_for(self, requests: Sequence[RequestSpec]) -> int | None:
        """The capture size this step replays at, or None when it runs eagerly."""
        if self.graphs is None:
            return None
        num_logits = sum(r.query_len if r.prompt_logprobs else 1 for r in requests)
        if num_logits > self.logit_slots:
            return None
        return padded_size(sum(r.query_len for r in requests), self.graphs.capture_sizes)

    def step(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        timer: object | None = None,
    ) -> StepOutput:
        self.model.attach_cache(self.cache)
        size = self.graph_size_for(requests)
        if size is None:
            step = self.prepare(requests, tokens, cache_indices)
            with region(timer, "prepare"):
                replay_batch = self.eager_replay_batch(step)
            logits, streams = run_eager(self.model, step, replay_batch=replay_batch, timer=timer)
            return StepOutput(logits, streams, step, replay_batch, None)
        self.capture()
        step = self.prepare(
            requests, tokens, cache_indices, pad_to=size, logit_slots=self.logit_slots
        )
        logits, streams, replay_batch = self.graphs.replay(step, size, timer)
        return StepOutput(
            logits[: step.num_logits],
            tuple(s[: step.num_tokens] for s in streams),
            step,
            replay_batch,
            size,
        )

    def eager_replay_batch(self, step: StepBatch) -> ReplayBatch | None:
        if self.policy == "full" or step.num_tokens < self.eager_trim_threshold:
            return None
        return build_replay_batch(step, self.policy, self.args, halo_align=self.halo_align)

    def reference_step(
        self,
        requests: Sequence[RequestSpec],
        tokens: Sequence[Sequence[int]],
        cache_indices: Sequence[int] | None = None,
        *,
        bounded: bool = False,
    ) -> StepOutput:
        """The full-batch path: every layer on every row. ``bounded`` masks decoder windows below
        each request's kept start under this engine's policy (the bounded reference, SPEC E1)."""
        self.model.attach_cache(self.cache)
        step = self.prepare(requests, tokens, cache_indices)
        layer_metadata = None
        if bounded:
            layer_metadata = bounded_reference_metadata(
                step, self.args, self.policy, self.halo_align
            )
        logits, streams = run_eager(self.model, step, layer_metadata=layer_metadata)
        return StepOutput(logits, streams, step, None, None)
