"""The one decision of a step: graph or eager, whole batch or replay batch, which rows it keeps.

vLLM's model runner decides a step's runtime mode and batch descriptor once and the forward
reads them; ``plan_step`` is that decision here. The engine carries its result into the forward
context (the replay batch, or none, and the shape mode attention gathers its keys in: static
inside a FULL graph), the capture code plans its dummy batches with it, and the
figures a run reports (kept rows, FLOPs, the ideal speedup) come from the plan of the step that
actually ran. Nothing else re-derives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swa_bench.engine.config import EngineConfig, replay_graphs_gate
from swa_bench.graphs.capture_sizes import padded_size
from swa_bench.model.args import ModelArgs
from swa_bench.model.forward_context import ShapeMode
from swa_bench.model.requests import RequestSpec
from swa_bench.replay.row_selection import (
    decoder_floors,
    floor_raises_window,
    gate_notes,
    halo_size,
    kept_lens,
    trims,
)


@dataclass(frozen=True)
class AgreedRoute:
    """What the data-parallel ranks agreed for a step (vLLM's DP rule): every rank replays if any
    rank does, and graph steps pad to the largest rank's capture size (None: some rank runs
    eagerly, so every rank does)."""

    replays: bool
    graph_size: int | None
    ranks: int


@dataclass(frozen=True)
class StepPlan:
    """How one step runs. ``kept_lens`` are the rows each request keeps on the replay batch (its
    query length when the decoder runs on the whole batch); ``decoder_floors`` the lowest
    position each request's decoder layers read on the replay batch (``row_selection.
    decoder_floor``: 0 but under ``final_window``; all 0 when the step does not replay)."""

    graph_size: int | None  # the capture size the step replays at; None: it runs eagerly
    shape_mode: ShapeMode  # how attention gathers its keys (``shape_mode_for``)
    replays: bool  # the rest of S and the decoder run on a replay batch of kept rows
    kept_lens: tuple[int, ...]
    num_tokens: int
    reason: str
    agreed: AgreedRoute | None = None  # the DP agreement this plan follows (None: one rank alone)
    # The replay capture size the replay batch pads to and runs in a graph of (None: eager).
    replay_graph_size: int | None = None
    decoder_floors: tuple[int, ...] = ()  # empty: no floors (a reference step)

    @property
    def num_kept(self) -> int:
        return sum(self.kept_lens)

    @property
    def trims(self) -> bool:
        return self.num_kept < self.num_tokens


def policy_kept_lens(
    requests: Sequence[RequestSpec], config: EngineConfig, args: ModelArgs
) -> tuple[int, ...]:
    """Rows each request keeps under the configured policy, whether or not the step replays."""
    halo = halo_size(args.window, args.n_decoder_layers, config.halo_align)
    return tuple(kept_lens(requests, config.policy, args.window, halo))


def graph_size_for(
    requests: Sequence[RequestSpec], config: EngineConfig, args: ModelArgs
) -> int | None:
    """The capture size a step pads to; None when it runs eagerly (eager mode, above the largest
    capture size, or more logits rows than a graph returns)."""
    if config.graph_mode == "eager":
        return None
    num_logits = sum(r.query_len if r.every_row_logits else 1 for r in requests)
    if num_logits > args.max_requests:
        return None
    return padded_size(sum(r.query_len for r in requests), config.capture_sizes)


def shape_mode_for(graph_size: int | None, config: EngineConfig) -> ShapeMode:
    """``static`` for a step that replays a FULL graph (its attention is captured, so it reads only
    device metadata at static shapes), ``varlen`` otherwise: eager steps and PIECEWISE graphs,
    whose attention runs as an eager break."""
    return "static" if graph_size is not None and config.graph_mode == "full" else "varlen"


def plan_step(
    requests: Sequence[RequestSpec],
    config: EngineConfig,
    args: ModelArgs,
    *,
    capture_size: int | None = None,
    agreed: AgreedRoute | None = None,
) -> StepPlan:
    """Plans ``requests`` as one step under a resolved ``config``.

    ``capture_size`` plans a graph's dummy batch at capture: a graph's route is fixed by its
    padded size, so capture and every later replay of that size agree (its dummy replay batch
    runs eagerly inside the capture: captures do not nest). ``agreed`` is the DP ranks'
    agreement on this step (from each rank's own plan): it fixes the route and the padded
    size; a rank with nothing to trim then runs the replay batch with every row kept, eagerly
    (each rank's kept rows differ, so no replay graph size is agreed). A step that replays in
    PIECEWISE mode runs its replay batch in the replay graph of the smallest replay capture size
    holding its kept rows, eagerly above the largest.
    Under ``final_window`` an eager step whose chunk keeps every row but has a floor above its
    batch start (``row_selection.decoder_floor``) runs the replay batch too: on the whole batch
    its decoder layers would read ring slots between ``cached - W`` and ``end - W`` that the
    earlier chunks, keeping only their rows in the final window, never wrote. A route without a
    replay batch (a PIECEWISE graph below trim_threshold, a FULL graph) applies no floor, as
    TensorRT-LLM plans no replay under CUDA graphs: its decoder reads from the batch start,
    which is valid only where the earlier chunks ran on the whole batch too.

    The engine gates are decided here once (``EngineConfig``): ``kv_block_reuse`` turns replay
    off for every step (TensorRT-LLM ``plan_decoder_replay``: no replay when
    ``_swa_is_reused``, "replaying into a reused window cache corrupts another request's
    prefix"); under ``tail`` prompt embeddings do (ATOM replays "an eager text prefill" only;
    from the issue's text, issue 30: ATOM's runtime gate was not found in its public code). The
    route names them, the per-request gates (``row_selection.gate_notes``) and a replay batch
    run eagerly for want of replay graphs (``config.replay_graphs_gate``).
    """
    query = tuple(r.query_len for r in requests)
    num_tokens = sum(query)
    lens = policy_kept_lens(requests, config, args)
    floors = tuple(decoder_floors(requests, config.policy, args.window))
    no_floors = (0,) * len(requests)
    if agreed is not None:
        route = "replay batch" if agreed.replays else "whole batch"
        shape = "eager" if agreed.graph_size is None else f"graph of {agreed.graph_size}"
        return StepPlan(
            graph_size=agreed.graph_size,
            shape_mode=shape_mode_for(agreed.graph_size, config),
            replays=agreed.replays,
            kept_lens=lens if agreed.replays else query,
            num_tokens=num_tokens,
            reason=f"DP agreement of {agreed.ranks} ranks: {route}, {shape}",
            agreed=agreed,
            decoder_floors=floors if agreed.replays else no_floors,
        )
    size = capture_size if capture_size is not None else graph_size_for(requests, config, args)
    if config.policy == "full":
        replays, reason = False, "policy full: the reference path"
    elif config.kv_block_reuse:
        replays = False
        reason = "kv_block_reuse: replay off (TensorRT-LLM replays no reused window cache)"
    elif config.policy == "tail" and config.prompt_embeds:
        replays = False
        reason = "tail: prompt embeddings are no text prefill (ATOM replays text prefills only)"
    elif size is not None and config.policy == "tail":
        replays = False
        reason = f"tail: a graph of {size} takes the whole batch (ATOM replays eager prefills only)"
    elif size is not None and config.graph_mode == "full":
        replays, reason = False, "FULL graph: the decoder stays on the whole batch"
    elif size is not None:
        replays = size >= config.trim_threshold
        relation = ">=" if replays else "<"
        reason = f"PIECEWISE graph of {size} {relation} trim_threshold {config.trim_threshold}"
    elif floor_raises_window(requests, floors, args.window):
        # Ahead of eager_trim_threshold: the earlier chunks' decoder rings hold nothing below the
        # floor, and only the replay batch reads from it (TensorRT-LLM applies it "even when this
        # chunk keeps all rows").
        replays = True
        reason = f"eager step: final_window floors {floors} above the batch starts"
    elif num_tokens < config.eager_trim_threshold:
        replays = False
        reason = f"eager step of {num_tokens} < eager_trim_threshold {config.eager_trim_threshold}"
    elif not trims(requests, lens):
        replays, reason = False, "no request loses a row"
    else:
        replays, reason = True, "eager step: some request loses rows"
    replay_size = None
    if replays and capture_size is None and config.replay_capture_sizes:
        replay_size = padded_size(sum(lens), config.replay_capture_sizes)
        reason += (f"; replay graph of {replay_size} for {sum(lens)} kept rows"
                   if replay_size is not None else
                   f"; {sum(lens)} kept rows above the largest replay graph "
                   f"{config.replay_capture_sizes[-1]}: eager")
    no_graphs = replay_graphs_gate(config.lora, config.prompt_embeds)
    if replays and capture_size is None and config.graph_mode == "piecewise" and no_graphs:
        reason += f"; replay batch eager: {no_graphs}"
    if notes := gate_notes(requests):
        reason += "; " + "; ".join(notes)
    return StepPlan(
        graph_size=size,
        shape_mode=shape_mode_for(size, config),
        replays=replays,
        kept_lens=lens if replays else query,
        num_tokens=num_tokens,
        reason=reason,
        replay_graph_size=replay_size,
        decoder_floors=floors if replays else no_floors,
    )
