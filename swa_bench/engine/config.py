"""How an engine runs steps: the replay policy, the graph mode and their thresholds.

One frozen value per configuration: the runner caches engines by it and the checks build engines
from it, so a configuration is spelled once. Which kernels run is part of it (``kernels``); the
``SWA_BENCH_*`` environment variables are only that setting's default, read here and nowhere
below the engine.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from swa_bench.graphs.capture_sizes import check_capture_sizes, default_capture_sizes
from swa_bench.kernels.config import Kernels, KernelSettings
from swa_bench.replay.row_selection import Policy

GraphMode = Literal["eager", "piecewise", "full"]
GRAPH_MODES: tuple[GraphMode, ...] = ("eager", "piecewise", "full")

# Where each kernel setting's default is read from: the A/B switches of a shell.
KERNEL_VARIABLES = {"backend": "SWA_BENCH_KERNELS", "tile": "SWA_BENCH_MQA_TILE",
                    "launch": "SWA_BENCH_TRITON_LAUNCH"}


def kernel_settings_from_environment(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernel settings ``environ`` (default ``os.environ``) asks for: the default of a
    scenario's ``kernels:`` section and of ``EngineConfig.kernels``. A malformed value is
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


@dataclass(frozen=True)
class EngineConfig:
    """``trim_threshold``: PIECEWISE graphs of this padded size or more run the decoder on a
    replay batch (None: W + 1, the smallest that can trim). ``eager_trim_threshold``: eager steps
    below this many tokens never replay. ``capture_sizes`` (None: vLLM's defaults up to
    ``max_capture_size``) are the padded sizes graphs are captured at. ``halo_align`` rounds the
    halo up (vLLM #57281 uses 512: 2414 -> 2560). ``kernels``: which kernels run (the engine
    resolves it for its device); unset, the environment's."""

    policy: Policy = "bounded"
    graph_mode: GraphMode = "eager"
    trim_threshold: int | None = None
    eager_trim_threshold: int = 0
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int = 512
    halo_align: int = 1
    kernels: KernelSettings = field(default_factory=kernel_settings_from_environment)

    def resolved(self, window: int) -> EngineConfig:
        """Every default filled in and checked against the model's window."""
        sizes = self.capture_sizes
        if sizes is None:
            sizes = tuple(default_capture_sizes(self.max_capture_size))
        check_capture_sizes(sizes)
        threshold = window + 1 if self.trim_threshold is None else self.trim_threshold
        if self.graph_mode == "piecewise" and threshold <= window:
            raise ValueError(f"trim_threshold ({threshold}) must exceed W ({window})")
        return dataclasses.replace(self, trim_threshold=threshold, capture_sizes=tuple(sizes))

    def reference(self) -> EngineConfig:
        """The reference path in the same graph mode: policy full, replay settings at their
        defaults (they play no part when nothing replays), so one reference serves every
        policy and threshold of a mode."""
        return EngineConfig(
            policy="full",
            graph_mode=self.graph_mode,
            capture_sizes=self.capture_sizes,
            max_capture_size=self.max_capture_size,
            kernels=self.kernels,
        )
