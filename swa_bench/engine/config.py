"""How an engine runs steps: the replay policy, the graph mode, their thresholds and the kernels.

One frozen value per configuration, every field set: the runner caches engines by it and the checks
build engines from it, so a configuration is spelled once. The defaults and the rules live here
once: ``EngineConfig.for_model`` fills what a caller leaves out (the scenario resolves its file
through it too), ``EngineConfig`` itself only asserts, and the scenario's validation reports the
same rules (``trim_threshold_problem``, ``capture_sizes_problem``) against the fields they name.
Which kernels run is part of it (``kernels``); the ``SWA_BENCH_*`` environment variables are
only that setting's default, read here and nowhere below the engine.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from swa_bench.graphs.capture_sizes import (
    capture_sizes_problem,
    default_capture_sizes,
    replay_capture_sizes,
)
from swa_bench.kernels.config import Kernels, KernelSettings
from swa_bench.model.args import ModelArgs
from swa_bench.replay.row_selection import Policy

GraphMode = Literal["eager", "piecewise", "full"]
GRAPH_MODES: tuple[GraphMode, ...] = ("eager", "piecewise", "full")

# Where each kernel setting's default is read from: the A/B switches of a shell.
KERNEL_VARIABLES = {"backend": "SWA_BENCH_KERNELS", "tile": "SWA_BENCH_MQA_TILE",
                    "launch": "SWA_BENCH_TRITON_LAUNCH",
                    "quantised_gemm": "SWA_BENCH_QUANTISED_GEMM"}


def kernel_settings_from_environment(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernel settings ``environ`` (default ``os.environ``) asks for: the default of a
    scenario's ``kernels:`` section and of ``EngineConfig.for_model``. A malformed value is
    refused in one line naming its variable."""
    environ = os.environ if environ is None else environ
    return KernelSettings.parse(**{f: environ.get(v, "") for f, v in KERNEL_VARIABLES.items()},
                                names=KERNEL_VARIABLES)


def triton_interpreting(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, Triton's own process-wide
    switch): read once per engine and carried in its ``Kernels``."""
    environ = os.environ if environ is None else environ
    return environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_kernels(settings: KernelSettings, device_type: str) -> Kernels:
    """``settings`` resolved for an engine on ``device_type``, under this process's interpreter
    switch: what the engine binds, and what its cases record."""
    return settings.resolve(device_type, triton_interpreting())


# Every engine default, once: ``EngineConfig.for_model`` and the scenario's fields take these.
DEFAULT_POLICY: Policy = "bounded"
DEFAULT_GRAPH_MODE: GraphMode = "eager"
DEFAULT_EAGER_TRIM_THRESHOLD = 0  # eager steps replay whatever their size
DEFAULT_MAX_CAPTURE_SIZE = 512  # vLLM's
DEFAULT_HALO_ALIGN = 1  # the halo unrounded


DEFAULT_REPLAY_GRAPHS = True  # PIECEWISE replay batches run in graphs of their own (vLLM's)


def default_replay_capture_sizes(
    args: ModelArgs, capture_sizes: Sequence[int], sizes: Sequence[int] | None = None
) -> list[int]:
    """vLLM's replay capture sizes for ``args``'s model beside model graphs of ``capture_sizes``:
    bounded by the largest model capture size and by ``max_requests`` x W; a step never holds
    more rows than the caches (``max_requests`` x ``max_seq_len``, the max_num_batched_tokens
    bound). ``sizes`` given: checked against that bound only."""
    return replay_capture_sizes(
        args.window, max_capture_size=max(capture_sizes), max_num_seqs=args.max_requests,
        max_num_batched_tokens=args.max_requests * args.max_seq_len, sizes=sizes,
    )


def replay_graphs_gate(lora: bool, prompt_embeds: bool) -> str | None:
    """Why replay batches get no graphs of their own, or None: vLLM builds no replay graphs
    with LoRA or prompt embeddings ("The graphs' fixed inputs hold no LoRA mapping and no None
    input ids", ``DeepseekV41ModelState.__init__``, ``vllm/models/deepseek_v41/nvidia/
    model_state.py``); its replay batches then run eagerly."""
    if lora or prompt_embeds:
        which = "LoRA" if lora else "prompt embeddings"
        return f"vLLM runs no replay graphs with {which} (replay batches run eagerly)"
    return None


def trim_threshold_problem(threshold: int, window: int) -> str | None:
    """The rule on ``trim_threshold``: nothing trims at or below W, so a threshold there would
    send steps to a replay batch that keeps every row."""
    if threshold <= window:
        return f"must exceed the model window W={window}, got {threshold}"
    return None


def default_trim_threshold(window: int) -> int:
    """W + 1: the smallest padded size that can trim."""
    return window + 1


@dataclass(frozen=True)
class EngineConfig:
    """``trim_threshold``: PIECEWISE graphs of this padded size or more run the decoder on a
    replay batch. ``eager_trim_threshold``: eager steps below this many tokens never replay.
    ``capture_sizes`` are the padded sizes graphs are captured at. ``halo_align`` rounds the halo
    up (vLLM #57281 uses 512: 2414 -> 2560). ``kernels``: which kernels run (the engine resolves
    it for its device). ``replay_capture_sizes``: the padded sizes a replay batch runs in a graph
    of its own at (PIECEWISE only; empty: replay batches run eagerly). Complete by construction
    (``for_model``); an invalid value raises here, and ``check`` holds the rules that need the
    model's window.

    The engine-level replay gates (README "Engine gates"), each applied whatever the policy:
    a gate is a property of the engine's cache or inputs, not of its row rule, so a user who
    combines vLLM's ``bounded`` rows with TensorRT-LLM's block reuse gets what such an engine
    would do, and the step's route names the gate. ``kv_block_reuse`` (TensorRT-LLM): no step
    replays (``dispatch.plan_step``). ``lora``, ``prompt_embeds`` (vLLM): no replay graphs,
    replay batches run eagerly (decided in ``for_model``); ``prompt_embeds`` also stops
    ``tail`` replaying (ATOM replays text prefills only)."""

    policy: Policy
    graph_mode: GraphMode
    trim_threshold: int
    eager_trim_threshold: int
    capture_sizes: tuple[int, ...]
    halo_align: int
    kernels: KernelSettings
    replay_capture_sizes: tuple[int, ...] = ()
    kv_block_reuse: bool = False
    lora: bool = False
    prompt_embeds: bool = False

    def __post_init__(self) -> None:
        if self.policy not in get_args(Policy):
            raise ValueError(f"policy: must be one of {get_args(Policy)}, got {self.policy!r}")
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode: must be one of {GRAPH_MODES}, got {self.graph_mode!r}")
        if not isinstance(self.capture_sizes, tuple):
            raise ValueError(f"capture_sizes: must be a tuple, got {self.capture_sizes!r}")
        if problem := capture_sizes_problem(self.capture_sizes):
            raise ValueError(f"capture_sizes: {problem}")
        if self.eager_trim_threshold < 0:
            raise ValueError(f"eager_trim_threshold: must be >= 0, got {self.eager_trim_threshold}")
        if self.halo_align < 1:
            raise ValueError(f"halo_align: must be >= 1, got {self.halo_align}")
        if not isinstance(self.kernels, KernelSettings):
            raise ValueError(f"kernels: must be KernelSettings, got {self.kernels!r}")
        if not isinstance(self.replay_capture_sizes, tuple):
            raise ValueError(f"replay_capture_sizes: must be a tuple, got "
                             f"{self.replay_capture_sizes!r}")
        if self.replay_capture_sizes:
            if self.graph_mode != "piecewise":
                raise ValueError("replay_capture_sizes: replay graphs run in PIECEWISE mode only, "
                                 f"not {self.graph_mode}")
            if problem := capture_sizes_problem(self.replay_capture_sizes):
                raise ValueError(f"replay_capture_sizes: {problem}")
            if problem := replay_graphs_gate(self.lora, self.prompt_embeds):
                raise ValueError(f"replay_capture_sizes: {problem}")

    @classmethod
    def for_model(
        cls,
        args: ModelArgs,
        *,
        policy: Policy = DEFAULT_POLICY,
        graph_mode: GraphMode = DEFAULT_GRAPH_MODE,
        trim_threshold: int | None = None,
        eager_trim_threshold: int = DEFAULT_EAGER_TRIM_THRESHOLD,
        capture_sizes: Sequence[int] | None = None,
        max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE,
        halo_align: int = DEFAULT_HALO_ALIGN,
        kernels: KernelSettings | None = None,
        replay_graphs: bool = DEFAULT_REPLAY_GRAPHS,
        replay_capture_sizes: Sequence[int] | None = None,
        kv_block_reuse: bool = False,
        lora: bool = False,
        prompt_embeds: bool = False,
    ) -> EngineConfig:
        """The complete configuration for ``args``'s model: the only place the defaults live.
        ``trim_threshold`` None: W + 1; ``capture_sizes`` None: vLLM's up to
        ``max_capture_size``; ``kernels`` None: the environment's. Replay graphs (PIECEWISE,
        ``replay_graphs``): ``replay_capture_sizes`` None takes vLLM's rule
        (``default_replay_capture_sizes``); with ``lora`` or ``prompt_embeds`` there are none
        (``replay_graphs_gate``)."""
        if capture_sizes is None:
            capture_sizes = default_capture_sizes(max_capture_size)
        if trim_threshold is None:
            trim_threshold = default_trim_threshold(args.window)
        if kernels is None:
            kernels = kernel_settings_from_environment()
        replay_sizes: Sequence[int] = ()
        if graph_mode == "piecewise" and replay_graphs and not replay_graphs_gate(lora,
                                                                                  prompt_embeds):
            replay_sizes = default_replay_capture_sizes(args, capture_sizes, replay_capture_sizes)
        return cls(policy=policy, graph_mode=graph_mode, trim_threshold=trim_threshold,
                   eager_trim_threshold=eager_trim_threshold, capture_sizes=tuple(capture_sizes),
                   halo_align=halo_align, kernels=kernels,
                   replay_capture_sizes=tuple(replay_sizes), kv_block_reuse=kv_block_reuse,
                   lora=lora, prompt_embeds=prompt_embeds).check(args.window)

    def check(self, window: int) -> EngineConfig:
        """``self``, once the rules that need the model's window hold (raises otherwise)."""
        if problem := trim_threshold_problem(self.trim_threshold, window):
            raise ValueError(f"trim_threshold: {problem}")
        return self

    def reference(self, args: ModelArgs) -> EngineConfig:
        """The reference path in the same graph mode and kernels: policy full, replay settings
        at their defaults (they play no part when nothing replays), so one reference serves
        every policy and threshold of a mode."""
        return EngineConfig.for_model(args, policy="full", graph_mode=self.graph_mode,
                                      capture_sizes=self.capture_sizes, kernels=self.kernels,
                                      replay_graphs=False)
