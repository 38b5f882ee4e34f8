"""Which kernels run, as a value: what a user asks for (``KernelSettings``) and what an engine
resolved it to for its device (``Kernels``, the ops table the model's call sites read).

The choice is made once per engine (``KernelSettings.resolve``) and carried in the forward
context; nothing below the engine reads the environment (``tests/test_architecture.py``). By
default the Triton kernels run on CUDA when Triton imports and the PyTorch path everywhere else
(it is also the oracle the kernels are tested against, and training's path: ``TORCH_KERNELS``).
Triton's interpreter (``TRITON_INTERPRET``, a process-wide switch of Triton's own) lets
``triton`` run on CPU tensors; the engine reads it once and it travels in ``Kernels.interpret``.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKENDS = ("torch", "triton")
LAUNCH_MODES = ("direct", "triton")
# How precision fp8's fp8 Linears multiply: bf16 GEMMs of the stored values (the default, what
# every figure so far ran), or the fp8 tensor-core kernel (``kernels.fp8_gemm``, Triton backend).
QUANTISED_GEMMS = ("bf16", "fp8")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def call_op(op, impl, *args):
    """``op(*args)``, the kernel's custom op, when a dispatch mode is on (torch's FLOP counter:
    it sees the op and its formula), else ``impl(*args)`` directly: a custom op's Python
    dispatch costs the host about 30 us a call, more than a small step's kernel takes."""
    return op(*args) if _get_current_dispatch_mode() is not None else impl(*args)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. Fixed per engine: a row's reduction order follows ``block_n``,
    so changing it between calls would break bitwise equality across batch shapes."""

    block_n: int = 32
    block_dv: int = 0  # output columns per program; 0: the whole head dim (one program per row)
    num_warps: int = 8
    num_stages: int = 1

    @classmethod
    def parse(cls, text: str, name: str = "tile") -> TileConfig:
        """``"block_n,block_dv,num_warps,num_stages"``; a malformed one is refused in one line
        that starts with ``name`` (where the user wrote it: a variable; empty: no prefix, for a
        caller that names the place itself)."""
        prefix = f"{name}: " if name else ""
        try:
            values = [int(v) for v in text.split(",")]
            if len(values) != 4:
                raise ValueError
            config = cls(*values)
        except ValueError:
            raise ValueError(f"{prefix}expected 4 integers "
                             f"'block_n,block_dv,num_warps,num_stages', got {text!r}") from None
        def power_of_two(n: int) -> bool:
            return n > 0 and not n & (n - 1)

        rules = (("block_n", config.block_n >= 16 and power_of_two(config.block_n),
                  "a power of two >= 16"),
                 ("block_dv", config.block_dv == 0 or (config.block_dv >= 16
                                                       and power_of_two(config.block_dv)),
                  "0 (the whole head) or a power of two >= 16"),
                 ("num_warps", config.num_warps in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
                 ("num_stages", config.num_stages >= 1, ">= 1"))
        for field, ok, what in rules:
            if not ok:
                raise ValueError(f"{prefix}{field} must be {what}, "
                                 f"got {getattr(config, field)}")
        return config

    def label(self) -> str:
        return f"{self.block_n},{self.block_dv},{self.num_warps},{self.num_stages}"


# Candidates the kernel benchmark's sweep times (``swa-bench kernels --sweep``).
TILE_CANDIDATES = (
    TileConfig(32, 0, 8, 1),
    TileConfig(32, 256, 8, 1),
    TileConfig(64, 256, 8, 2),
    TileConfig(32, 256, 4, 2),
    TileConfig(16, 0, 4, 1),
    TileConfig(64, 0, 8, 1),
    TileConfig(64, 0, 8, 2),
    TileConfig(128, 0, 8, 1),
    TileConfig(128, 256, 8, 1),
    # Four warpgroups: half the fp32 accumulator per thread of eight warps (64 heads x 512).
    TileConfig(64, 0, 16, 1),
    TileConfig(64, 0, 16, 2),
    TileConfig(32, 0, 16, 2),
    TileConfig(32, 0, 8, 2),
    TileConfig(32, 0, 8, 3),
)


# The defaults measured on an H200 (torch 2.11, Triton 3.6, `swa-bench kernels --sweep`, 16K
# tokens, bf16): attention over a causal range of keys (dense, compressed) ran fastest with
# 64-key blocks in two stages (324 TFLOP/s dense, against 251 in one stage: the range loop is a
# for loop the compiler pipelines), gathered-only attention (window, sparse top-k: 512 + 128 keys
# a row) with 64-key blocks in two stages (246 TFLOP/s, 56% of its byte roofline, against 167 with
# 32-key blocks in one). fp32 keys take 32-key blocks. The choice follows the layer's kind of
# sources and the dtype, never the batch's shape, so a row's reduction order stays
# batch-invariant.
CAUSAL_RANGE_TILE = TileConfig(64, 0, 8, 2)
GATHERED_TILE = TileConfig(64, 0, 8, 2)
FP32_TILE = TileConfig(32, 0, 8, 1)


def default_tile(causal_range: bool, dtype: torch.dtype) -> TileConfig:
    """The measured tile for the kind of sources. fp32 keeps 32-key blocks in one stage: a
    64-key block of 512-wide fp32 keys and the 64 heads' queries need 272 KiB of shared memory,
    over the H200's 227 KiB."""
    if dtype.itemsize > 2:
        return FP32_TILE
    return CAUSAL_RANGE_TILE if causal_range else GATHERED_TILE


@dataclass(frozen=True)
class KernelSettings:
    """What a user asks for: ``backend`` auto (Triton on CUDA when it imports, else PyTorch),
    torch or triton; ``tile`` the attention kernel's (None: the measured defaults per kind of
    sources and dtype); ``launch`` how compiled Triton kernels are called (``direct``, or
    ``triton``: Triton's own path, the A/B switch); ``quantised_gemm`` how precision fp8's fp8
    Linears multiply (``bf16``: GEMMs of the stored values; ``fp8``: ``kernels.fp8_gemm``, which
    needs the Triton backend)."""

    backend: str = "auto"
    tile: TileConfig | None = None
    launch: str = "direct"
    quantised_gemm: str = "bf16"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend: must be one of auto, {', '.join(BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.launch not in LAUNCH_MODES:
            raise ValueError(f"launch: must be one of {', '.join(LAUNCH_MODES)}, "
                             f"got {self.launch!r}")
        if self.quantised_gemm not in QUANTISED_GEMMS:
            raise ValueError(f"quantised_gemm: must be one of {', '.join(QUANTISED_GEMMS)}, "
                             f"got {self.quantised_gemm!r}")

    @classmethod
    def parse(cls, backend: str = "", tile: str = "", launch: str = "", quantised_gemm: str = "",
              *, names: Mapping[str, str] | None = None) -> KernelSettings:
        """From text, blank fields at their defaults; a malformed field is refused in one line
        that starts with its name (``names`` maps a field to where it was written)."""
        names = {"backend": "backend", "tile": "tile", "launch": "launch",
                 "quantised_gemm": "quantised_gemm", **(names or {})}
        chosen = backend.strip().lower()
        if chosen and chosen not in ("auto", *BACKENDS):
            raise ValueError(f"{names['backend']}: must be one of auto, {', '.join(BACKENDS)}, "
                             f"got {chosen!r}")
        mode = launch.strip().lower() or "direct"
        if mode not in LAUNCH_MODES:
            raise ValueError(f"{names['launch']}: must be one of {', '.join(LAUNCH_MODES)}, "
                             f"got {launch!r}")
        gemm = quantised_gemm.strip().lower() or "bf16"
        if gemm not in QUANTISED_GEMMS:
            raise ValueError(f"{names['quantised_gemm']}: must be one of "
                             f"{', '.join(QUANTISED_GEMMS)}, got {quantised_gemm!r}")
        parsed = TileConfig.parse(tile.strip(), names["tile"]) if tile.strip() else None
        return cls(chosen or "auto", parsed, mode, gemm)

    def resolve(self, device_type: str, interpret: bool) -> Kernels:
        """The kernels an engine on ``device_type`` runs; a triton backend must be runnable
        there (CUDA, or Triton's interpreter, and the triton package), and the fp8 GEMM needs
        it: asked for on the PyTorch path it is refused, never silently dropped."""
        runnable = triton_available() and (device_type == "cuda" or interpret)
        if self.backend == "triton" and not runnable:
            raise ValueError("kernels: backend triton needs CUDA (or TRITON_INTERPRET=1) and the "
                             "triton package")
        if self.backend == "auto":
            backend = "triton" if runnable and device_type == "cuda" else "torch"
        else:
            backend = self.backend
        if self.quantised_gemm == "fp8" and backend != "triton":
            raise ValueError(f"kernels: quantised_gemm fp8 needs the triton backend, and "
                             f"{self.backend} resolves to {backend} on {device_type}")
        return Kernels(backend, self.tile, self.launch, interpret, self.quantised_gemm)


@dataclass(frozen=True)
class Kernels:
    """The resolved choice, bound once per engine and read by every fused call site through the
    forward context: which implementation runs, the attention tile, the launch path,
    whether Triton interprets (CPU tensors; its dot precision then differs), and how precision
    fp8's fp8 Linears multiply (``fp8_linears``). Recorded per case through
    ``model.precision.quantised_gemm``."""

    backend: str = "torch"
    tile: TileConfig | None = None
    launch: str = "direct"
    interpret: bool = False
    quantised_gemm: str = "bf16"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS or self.launch not in LAUNCH_MODES:
            raise ValueError(f"Kernels: backend {self.backend!r} or launch {self.launch!r} "
                             f"is not one of {BACKENDS} / {LAUNCH_MODES}")
        if self.quantised_gemm not in QUANTISED_GEMMS or (
                self.quantised_gemm == "fp8" and not self.triton):
            raise ValueError(f"Kernels: quantised_gemm {self.quantised_gemm!r} is not one of "
                             f"{QUANTISED_GEMMS}, or fp8 without the triton backend")

    @property
    def triton(self) -> bool:
        return self.backend == "triton"

    def inference(self, *tensors: torch.Tensor) -> bool:
        """Whether the fused inference kernels (they have no backward) take these tensors: the
        Triton backend and no gradient wanted through any. The one decision behind
        ``fused_hc``, ``fused_moe``, ``fused_rope`` and ``fused_latents``."""
        return self.triton and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    def tile_for(self, causal_range: bool = False,
                 dtype: torch.dtype = torch.bfloat16) -> TileConfig:
        """The attention kernel's tile: the chosen one, else the measured default for the kind
        of sources and the dtype (never the batch's shape: a row's reduction order stays
        batch-invariant)."""
        return self.tile if self.tile is not None else default_tile(causal_range, dtype)

    def precision(self, dtype: torch.dtype) -> str:
        """A kernel's ``tl.dot`` precision: fp32 in full precision (the oracle's); bf16/fp16 on
        tensor cores. The interpreter (CPU) computes in exact fp32 after rounding to the input
        dtype as the GPU does (its bf16 dot is wrong)."""
        if self.interpret:
            return "interpret"
        return "ieee" if dtype == torch.float32 else "tf32"

    def fp8_linears(self, *tensors: torch.Tensor) -> bool:
        """Whether precision fp8's fp8 Linears on these tensors run ``kernels.fp8_gemm``: chosen,
        and the inference kernels take them (no gradient wanted: the kernel has no backward)."""
        return self.quantised_gemm == "fp8" and self.inference(*tensors)

    @property
    def direct_launch(self) -> bool:
        """Whether ``kernels.launch`` may call compiled kernels directly: not interpreted and
        the direct launch mode."""
        return not self.interpret and self.launch == "direct"

    def record(self) -> dict[str, str | bool]:
        """What results.json stores per case, what ran: two runs compare only when these agree.
        The PyTorch path runs no Triton kernel, so its tile, launch mode and interpreter are
        none ("-", "-", False): settings that changed nothing never part two runs."""
        if not self.triton:
            return {"backend": self.backend, "tile": "-", "launch": "-", "interpret": False}
        return {"backend": self.backend,
                "tile": "auto" if self.tile is None else self.tile.label(),
                "launch": self.launch, "interpret": self.interpret}


# The PyTorch path: the oracle's, training's, and a forward run without a context's.
TORCH_KERNELS = Kernels()
