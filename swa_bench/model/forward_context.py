"""The forward context: what layers read during one forward besides their inputs.

Layers never take metadata as arguments: a captured graph freezes arguments, so everything that
changes per step (attention metadata, the replay batch) is read from here when the code runs, and
graph segments read it only through static buffers. The replay batch runs its layers under a
context of its own, like a microbatch.

The engine decides once per step whether the decoder runs on a replay batch and puts that batch
here (``replay_batch``, None for the whole batch); nothing below the engine re-derives it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

if TYPE_CHECKING:
    from swa_bench.model.batch import AttentionMetadata

# How attention gathers its keys (``engine.dispatch.plan_step`` decides it): ``varlen`` walks the
# requests with host integers (eager, and PIECEWISE graphs' eager breaks); ``static`` reads only
# device metadata at static shapes, as a FULL graph must. Which kernels run is another setting.
ShapeMode = Literal["varlen", "static"]


class RegionTimer(Protocol):
    """Times named regions of a forward (the replay step's breakdown); the benchmark supplies it,
    so the model never imports the benchmark."""

    def region(self, name: str) -> contextlib.AbstractContextManager[None]: ...


def region(timer: RegionTimer | None, name: str) -> contextlib.AbstractContextManager[None]:
    """``timer.region(name)``, or a no-op when timing is off, so call sites need no branch."""
    return contextlib.nullcontext() if timer is None else timer.region(name)


@dataclass(frozen=True)
class BatchDescriptor:
    """The shape a forward runs at: its padded token count, fixed per captured graph."""

    num_tokens: int


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    batch_descriptor: BatchDescriptor
    # Per-layer metadata overrides: the first replay layer on the replay batch reads the batch's
    # window KV; the bounded reference masks decoder layers below the kept starts.
    layer_metadata: dict[int, AttentionMetadata] = field(default_factory=dict)
    shape_mode: ShapeMode = "varlen"
    # The step's replay batch (``swa_bench.replay.ReplayBatch``) when the engine decided the
    # decoder runs on kept rows; None: the whole batch. Typed loosely: the model does not import
    # the replay package that builds it.
    replay_batch: Any = None
    # Sparse attention: each index source's selection [rows, top_k] for the layers after it, set
    # when the index source runs in this forward (a replay batch has a context of its own).
    index_selection: dict[int, torch.Tensor] = field(default_factory=dict)
    # Selections fixed by the caller: an index source listed here publishes the given selection
    # instead of its own. E1/E2's full-batch truth reads the replay's, so that a top-k near-tie
    # which rounding decided the other way (judged apart) does not pass for an output error.
    given_selection: dict[int, torch.Tensor] = field(default_factory=dict)
    # When a dict, each index source records its ``IndexQuery`` here (the checks score the rows
    # whose selections differ); None on the timed path, so nothing is kept alive.
    index_queries: dict[int, Any] | None = None
    timer: RegionTimer | None = None

    def metadata_for(self, layer: int) -> AttentionMetadata:
        return self.layer_metadata.get(layer, self.attn_metadata)


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: run the model through set_forward_context")
    return _current


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Installs ``ctx`` for the duration; nests (the replay batch overrides the step's)."""
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
