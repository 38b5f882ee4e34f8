"""Which attention implementation runs, decided in one place, the Triton kernel's tile sizes,
and how compiled Triton kernels are launched.

``SWA_BENCH_KERNELS=torch|triton`` overrides the choice (tests, A/B runs); by default the Triton
kernels run on CUDA when Triton imports and the PyTorch path everywhere else (it is also the oracle
the kernels are tested against). ``TRITON_INTERPRET=1`` lets ``triton`` run on CPU tensors.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

BACKENDS = ("torch", "triton")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_forced: dict[str, object] = {}


@contextlib.contextmanager
def forced(backend: str | None = None, tile: TileConfig | None = None) -> Iterator[None]:
    """Runs the block with this backend and tile whatever the environment says (the kernel
    benchmark times both paths, and each tile of a sweep, in one process)."""
    saved = dict(_forced)
    _forced.update({k: v for k, v in (("backend", backend), ("tile", tile)) if v is not None})
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def attention_backend(device: torch.device) -> str:
    """``torch`` or ``triton`` for attention on ``device``; the override must be runnable. Asked
    by every fused step of every layer: the decision itself is cached per setting."""
    chosen = _forced.get("backend") or os.environ.get("SWA_BENCH_KERNELS", "")
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _decide_backend(str(chosen), kind, interpreting())


@functools.cache
def _decide_backend(chosen: str, device_type: str, interpret: bool) -> str:
    chosen = chosen.strip().lower()
    if chosen and chosen not in BACKENDS:
        raise ValueError(f"SWA_BENCH_KERNELS: must be one of {', '.join(BACKENDS)}, got {chosen!r}")
    runnable = triton_available() and (device_type == "cuda" or interpret)
    if chosen == "triton" and not runnable:
        raise ValueError("SWA_BENCH_KERNELS: triton needs CUDA (or TRITON_INTERPRET=1) and the "
                         "triton package")
    if chosen:
        return chosen
    return "triton" if runnable and device_type == "cuda" else "torch"


LAUNCH_MODES = ("direct", "triton")


def launch_mode() -> str:
    """How ``kernels.launch`` calls a compiled Triton kernel: ``direct`` (default) or through
    Triton's own path (``SWA_BENCH_TRITON_LAUNCH=triton``, the A/B switch)."""
    return _launch_mode(os.environ.get("SWA_BENCH_TRITON_LAUNCH", ""))


@functools.cache
def _launch_mode(text: str) -> str:
    mode = text.strip().lower() or "direct"
    if mode not in LAUNCH_MODES:
        raise ValueError(f"SWA_BENCH_TRITON_LAUNCH: must be one of {', '.join(LAUNCH_MODES)}, "
                         f"got {text!r}")
    return mode


def check_environment() -> None:
    """Raises ``ValueError`` (one line naming the variable) for a malformed ``SWA_BENCH_*``
    setting, so a command refuses it before anything runs instead of failing every case."""
    chosen = os.environ.get("SWA_BENCH_KERNELS", "").strip().lower()
    if chosen and chosen not in BACKENDS:
        _decide_backend(chosen, "cpu", False)  # raises the backend decision's own message
    _env_tile()
    launch_mode()


def inference_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the fused inference kernels (they have no backward) take these tensors: the Triton
    backend is chosen for the first one's device and no gradient is wanted through any. The one
    decision behind ``fused_hc``, ``fused_moe`` and ``fused_rope``."""
    return attention_backend(tensors[0].device) == "triton" and not (
        torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def call_op(op, impl, *args):
    """``op(*args)``, the kernel's custom op, when a dispatch mode is on (torch's FLOP counter:
    it sees the op and its formula), else ``impl(*args)`` directly: a custom op's Python
    dispatch costs the host about 30 us a call, more than a small step's kernel takes."""
    return op(*args) if _get_current_dispatch_mode() is not None else impl(*args)


def dot_precision(dtype: torch.dtype) -> str:
    """A kernel's ``tl.dot`` precision: fp32 in full precision (the oracle's); bf16/fp16 on tensor
    cores. The interpreter (CPU) computes in exact fp32 after rounding to the input dtype as the
    GPU does (its bf16 dot is wrong)."""
    if interpreting():
        return "interpret"
    return "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. Fixed per process: a row's reduction order follows ``block_n``,
    so changing it between calls would break bitwise equality across batch shapes."""

    block_n: int = 32
    block_dv: int = 0  # output columns per program; 0: the whole head dim (one program per row)
    num_warps: int = 8
    num_stages: int = 1

    @classmethod
    def parse(cls, text: str) -> TileConfig:
        """``"block_n,block_dv,num_warps,num_stages"`` (the ``SWA_BENCH_MQA_TILE`` format)."""
        try:
            values = [int(v) for v in text.split(",")]
            if len(values) != 4:
                raise ValueError
            config = cls(*values)
        except ValueError:
            raise ValueError(f"SWA_BENCH_MQA_TILE: expected 4 integers "
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
        for name, ok, what in rules:
            if not ok:
                raise ValueError(f"SWA_BENCH_MQA_TILE: {name} must be {what}, "
                                 f"got {getattr(config, name)}")
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


def tile_config(causal_range: bool = False, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    """The tile of this process: forced, else ``SWA_BENCH_MQA_TILE``, else the measured default
    for the kind of sources. fp32 keeps 32-key blocks in one stage: a 64-key block of 512-wide
    fp32 keys and the 64 heads' queries need 272 KiB of shared memory, over the H200's 227 KiB."""
    forced_tile = _forced.get("tile") or _env_tile()
    if forced_tile is not None:
        return forced_tile
    if dtype.itemsize > 2:
        return FP32_TILE
    return CAUSAL_RANGE_TILE if causal_range else GATHERED_TILE


@functools.cache
def _env_tile() -> TileConfig | None:
    text = os.environ.get("SWA_BENCH_MQA_TILE", "").strip()
    return TileConfig.parse(text) if text else None
