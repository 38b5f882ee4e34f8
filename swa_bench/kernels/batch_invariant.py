"""The batch-invariant mode of the checks: every op computes a row in the same order whatever
batch the row sits in, so a replay batch's kept rows and the same rows inside the full batch are
equal bit for bit (issue 29; Thinking Machines' ``batch_invariant_ops`` and vLLM's
``VLLM_BATCH_INVARIANT`` are the prior art, for one batch size against another). A PASS in the
mode needs no trust in it: the checks compare bitwise, so an op it missed is a FAIL.

What makes a row's bits depend on its batch on CPU, measured on ``sparse-tiny`` in fp32 (the
bounded and halo E1 truth envelopes were 1.4e-6 to 2.4e-6 without this mode, 0 with it):

* **GEMMs take another kernel by row count**: a GEMM of fewer than 8 rows takes another path,
  and inside a larger GEMM a row's result depends on where it falls in the micro-kernel's tile
  (a tile of 6 rows on AVX2, so padding to tiles of 8 did not help). Here every ``F.linear``,
  ``matmul``, ``bmm``, ``einsum`` and ``_grouped_mm`` is computed one leading row at a time, a
  call whose shapes are the row's alone.
* **Transcendental elementwise ops take a vector or a scalar path by position**: ``sigmoid``,
  ``exp`` and the like run SIMD (Sleef) over whole vectors and scalar code (libm) over a flat
  tensor's last partial vector, and the two differ in the last bit; the same mHC row came out
  differently as row 11 of 12 and row 76 of 77. Here their input is flattened and padded to a
  whole number of vectors, so every element takes the vector path.
* **Threads split the work at batch-dependent points**: the mode runs on one thread.

Reductions along a row (``sum``, ``mean``, ``softmax``, ``rms_norm`` over the last dim) already
are invariant on CPU (checked in the tests).

On CUDA the sources differ, and so does the mode (``TritonBatchInvariantOps``, a dispatch mode:
it sees the GEMMs that ``F.linear``, ``einsum`` and ``matmul`` decompose to). Measured on the
H200 (``scripts/invariant_gpu.py probe``, v41-flash, a 16K step's calls against their last 1, 8,
128, 896 and 4099 rows):

* **cuBLAS picks its kernel and split-K by shape**: 7 of the step's 14 GEMM shapes gave other
  bits for some of those row counts. ``mm``, ``addmm``, ``bmm`` (and ``linear`` where it reaches
  the mode whole) run ``triton_invariant``'s fixed-tile GEMM: one program per output tile, K in
  order, no split.
* **torch's reductions split a row by the number of rows**: a row sum over 5120 differed at 1
  and 8 rows. ``sum`` and ``mean`` over some dims run its row reduction, one order per row.
* The rest is invariant by construction or measured so: the model's Triton kernels (attention,
  indexer, mHC, MoE routing, latents) compute a row in one program in a fixed key order;
  ``softmax`` and ``rms_norm`` reduce a row within one block; ``torch._grouped_mm`` (the routed
  experts in bf16) was row-invariant at the shapes measured (issue 29); top-k ranks unique keys.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from swa_bench.kernels.config import Kernels, next_pow2
from swa_bench.kernels.launch import launch

# Padded to a multiple of this many elements: every SIMD width and unroll torch's CPU kernels use
# (AVX-512: 16 fp32 lanes, unrolled twice).
VECTOR_PAD = 64

# Elementwise functions computed by a vector and a scalar implementation that may disagree.
TRANSCENDENTAL = frozenset({"sigmoid", "exp", "expm1", "log", "log1p", "tanh", "silu",
                            "softplus", "rsqrt", "sqrt", "sin", "cos", "erf", "gelu"})

_MATMULS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm,
            torch.Tensor.mm)


def _by_row(fn: Callable[..., torch.Tensor], x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    """``fn(x, *rest)`` one slice of ``x``'s first dim at a time (each call the same shapes)."""
    if x.shape[0] == 0:
        return fn(x, *rest, **kwargs)
    return torch.cat([fn(x[i : i + 1], *rest, **kwargs) for i in range(x.shape[0])])


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    flat = x.reshape(-1, x.shape[-1])
    out = _by_row(F.linear, flat, weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dim() == 2 and b.dim() == 2:
        return _by_row(torch.matmul, a, b)
    if a.dim() == 3 and b.dim() == 3:
        return _bmm(a, b)
    if a.dim() >= 2 and b.dim() == 2:
        return _linear(a, b.t())
    return torch.matmul(a, b)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each batch entry alone, each of its rows alone."""
    if a.shape[0] == 0:
        return torch.bmm(a, b)
    return torch.stack([_by_row(torch.matmul, a[i], b[i]) for i in range(a.shape[0])])


def _einsum(pattern: str, *operands: torch.Tensor) -> torch.Tensor:
    """Row-sliced along the first operand's first index; an operand indexed by the same letter
    first is sliced with it (``"chd,cnd->chn"``), the others are shared (``"chd,nd->chn"``)."""
    inputs, output = pattern.replace(" ", "").split("->")
    terms = inputs.split(",")
    row = terms[0][0]
    if not output.startswith(row) or operands[0].shape[0] == 0:
        return torch.einsum(pattern, *operands)
    rows = []
    for i in range(operands[0].shape[0]):
        sliced = [t[i : i + 1] if term[0] == row else t for term, t in zip(terms, operands,
                                                                        strict=True)]
        rows.append(torch.einsum(pattern, *sliced))
    return torch.cat(rows)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, **_) -> torch.Tensor:
    """``x``'s rows in groups ending at ``offs``, each row alone against its group's ``w[g]``;
    the group of a row found on the device (no host read: a captured graph replays it with
    other group sizes)."""
    if x.shape[0] == 0:
        return x.new_zeros(0, w.shape[-1])
    rows = torch.arange(x.shape[0], device=x.device, dtype=offs.dtype)
    groups = torch.searchsorted(offs, rows, right=True).clamp_(max=w.shape[0] - 1)
    return torch.cat([x[i : i + 1] @ w.index_select(0, groups[i : i + 1])[0]
                      for i in range(x.shape[0])])


def _transcendental(name: str, x: torch.Tensor, *rest, **kwargs) -> torch.Tensor:
    base = name.rstrip("_")
    fn = getattr(torch, base, None) or getattr(F, base)
    flat = x.contiguous().view(-1)
    pad = (-flat.numel()) % VECTOR_PAD
    padded = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    y = fn(padded, *rest, **kwargs)[: flat.numel()].view(x.shape)
    if name.endswith("_"):  # in place: write the invariant result back
        return x.copy_(y)
    return y


class BatchInvariantOps(TorchFunctionMode):
    """The CPU mode: the ops above replaced while it is on (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunction():
            return self._dispatch(func, args, kwargs)

    @staticmethod
    def _dispatch(func, args, kwargs):
        out = kwargs.pop("out", None) if func in (torch.bmm, *_MATMULS) else None
        if func is F.linear and args[0].dim() >= 2:
            result = _linear(*args, **kwargs)
        elif func in _MATMULS:
            result = _matmul(*args)
        elif func in (torch.bmm, torch.Tensor.bmm):
            result = _bmm(*args)
        elif func is torch.einsum and isinstance(args[0], str) and len(args) > 2:
            result = _einsum(*args)
        elif func is getattr(torch, "_grouped_mm", None):
            result = _grouped_mm(*args, **kwargs)
        elif (getattr(func, "__name__", "").rstrip("_") in TRANSCENDENTAL and args
              and isinstance(args[0], torch.Tensor) and args[0].is_floating_point()
              and args[0].device.type == "cpu" and args[0].numel()):
            return _transcendental(func.__name__, *args, **kwargs)
        else:
            return func(*args, **kwargs)
        if out is not None:
            return out.copy_(result)
        return result


# --- CUDA: fixed-tile Triton kernels in place of cuBLAS and torch's reductions ---------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per dtype: constants, never the batch's shape.
GEMM_TILES = {torch.bfloat16: (128, 128, 64, 8, 3), torch.float16: (128, 128, 64, 8, 3),
              torch.float32: (64, 64, 32, 4, 2)}
REDUCE_ELEMENTS = 4096  # a row reduction's tile: BLOCK_R x BLOCK_C elements
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension: the GEMM's batch entries
INT32_OFFSETS = 1 << 31  # the kernel's K offsets (``k0 * stride``) are 32-bit


def invariant_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *,
                   alpha: float = 1.0, beta: float = 1.0, out: torch.Tensor | None = None,
                   interpret: bool = False) -> torch.Tensor:
    """``alpha * a @ b + beta * bias`` for ``a [M, K], b [K, N]`` or ``a [B, M, K], b [B, K, N]``
    (any strides; ``bias`` broadcast to the output), in ``a``'s dtype, written into ``out`` when
    given (any strides)."""
    from swa_bench.kernels import triton_invariant

    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    batch, m, k = a3.shape
    n = b3.shape[2]
    c = out if out is not None else a.new_empty((batch, m, n) if batched else (m, n))
    c3 = c if batched else c[None]
    if c3.numel() == 0:
        return c
    if bias is not None and beta == 0:  # as torch: a bias times 0 is not read (NaN stays out)
        bias = None
    if k == 0:
        c3.zero_()
        if bias is not None:
            c3.add_(bias, alpha=beta)
        return c
    # The kernel steps along K by ``k0 * stride`` in 32 bits: an operand whose K offsets pass
    # 2^31 elements is copied K-contiguous first (same values, same order of sums).
    if (k - 1) * abs(a3.stride(2)) >= INT32_OFFSETS:
        a3 = a3.contiguous()
    if (k - 1) * abs(b3.stride(1)) >= INT32_OFFSETS:
        b3 = b3.transpose(1, 2).contiguous().transpose(1, 2)
    bias3 = bias.expand(c3.shape) if bias is not None else c3
    # The interpreter truncates fp32 to bf16: it writes fp32, rounded by torch as the GPU would.
    dest = c3.float() if interpret and c3.dtype != torch.float32 else c3
    block_m, block_n, block_k, warps, stages = GEMM_TILES[a.dtype]
    precision = Kernels("triton", interpret=interpret).precision(a.dtype)  # the dot's, as ever
    for g in range(0, batch, MAX_GRID_Z):  # batch entries are independent programs
        part = slice(g, g + MAX_GRID_Z)
        launch(triton_invariant.invariant_gemm_kernel,
               (-(-m // block_m), -(-n // block_n), min(MAX_GRID_Z, batch - g)),
               a3[part], b3[part], dest[part], bias3[part], m, n, k, *a3.stride(),
               *b3.stride(), *dest.stride(), *bias3.stride(), float(alpha), float(beta),
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
               PRECISION=precision, direct=not interpret,
               num_warps=warps, num_stages=stages)
    if dest is not c3:
        c3.copy_(dest)
    return c


def invariant_reduce(x: torch.Tensor, dims: list[int], keepdim: bool = False,
                     dtype: torch.dtype | None = None, *, mean: bool = False,
                     interpret: bool = False) -> torch.Tensor:
    """``x.sum(dims)`` (or ``mean``) with fp32 sums in one fixed order a row: the reduced dims
    moved last (a copy where they are not), one row reduction over them."""
    from swa_bench.kernels import triton_invariant

    reduced = sorted({d % x.dim() for d in dims})
    kept = [d for d in range(x.dim()) if d not in reduced]
    rows = math.prod(x.shape[d] for d in kept)
    cols = math.prod(x.shape[d] for d in reduced)
    flat = x.permute(*kept, *reduced).contiguous().view(rows, cols)
    out = x.new_empty(rows, dtype=dtype or x.dtype)
    dest = out.float() if interpret else out  # as in invariant_gemm
    block_c = max(16, min(next_pow2(cols), 1024))
    block_r = max(1, REDUCE_ELEMENTS // block_c)
    launch(triton_invariant.invariant_row_sum_kernel, (-(-rows // block_r),),
           flat, dest, rows, cols, cols, float(cols if mean else 1),
           BLOCK_R=block_r, BLOCK_C=block_c, direct=not interpret, num_warps=4, num_stages=1)
    if dest is not out:
        out.copy_(dest)
    shape = [1 if d in reduced else x.shape[d] for d in range(x.dim())] if keepdim else \
        [x.shape[d] for d in kept]
    return out.view(shape)


class TritonBatchInvariantOps(TorchDispatchMode):
    """The CUDA mode (see the module docstring): the GEMMs and reductions whose bits depend on
    the batch, on ``device_type``'s tensors of a floating dtype, run the invariant kernels;
    everything else runs as it would. ``interpret``: Triton's interpreter (CPU tests)."""

    def __init__(self, device_type: str = "cuda", interpret: bool = False) -> None:
        super().__init__()
        self.device_type = device_type
        self.interpret = interpret
        aten = torch.ops.aten
        self._handlers = {
            aten.mm.default: self._mm, aten.mm.out: self._mm,
            aten.bmm.default: self._mm, aten.bmm.out: self._mm,
            aten.addmm.default: self._addmm, aten.linear.default: self._linear,
            aten.sum.dim_IntList: self._sum, aten.mean.dim: self._mean,
        }

    def _takes(self, *tensors: torch.Tensor | None) -> bool:
        return all(t is None or (t.device.type == self.device_type and t.dtype in GEMM_TILES)
                   for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            result = handler(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)

    def _mm(self, a, b, *, out=None):
        if not self._takes(a, b, out) or a.dtype != b.dtype or a.dim() != b.dim():
            return NotImplemented
        if out is not None:  # torch resizes or refuses a misshapen or overlapping ``out``
            shape = (*a.shape[:-1], b.shape[-1])
            storages = {t.untyped_storage().data_ptr() for t in (a, b)}
            if (out.dtype != a.dtype or tuple(out.shape) != shape
                    or out.untyped_storage().data_ptr() in storages):
                return NotImplemented
        return invariant_gemm(a, b, out=out, interpret=self.interpret)

    def _addmm(self, bias, a, b, *, beta=1, alpha=1):
        if not self._takes(bias, a, b) or not a.dtype == b.dtype == bias.dtype:
            return NotImplemented
        return invariant_gemm(a, b, bias, alpha=alpha, beta=beta, interpret=self.interpret)

    def _linear(self, x, weight, bias=None):
        if not self._takes(x, weight, bias) or x.dtype != weight.dtype or weight.dim() != 2:
            return NotImplemented
        flat = x.reshape(-1, x.shape[-1])
        y = invariant_gemm(flat, weight.t(), bias, interpret=self.interpret)
        return y.view(*x.shape[:-1], weight.shape[0])

    def _sum(self, x, dim=None, keepdim=False, *, dtype=None):
        return self._reduce(x, dim, keepdim, dtype, mean=False)

    def _mean(self, x, dim=None, keepdim=False, *, dtype=None):
        return self._reduce(x, dim, keepdim, dtype, mean=True)

    def _reduce(self, x, dim, keepdim, dtype, mean):
        """Reductions over some dims only (a whole-tensor reduction has no rows) of a non-empty
        floating tensor into a floating dtype."""
        dims = [dim] if isinstance(dim, int) else list(dim or [])
        if (not self._takes(x) or not dims or x.dim() == 0 or x.numel() == 0
                or (dtype is not None and dtype not in GEMM_TILES)):
            return NotImplemented
        if (any(not -x.dim() <= d < x.dim() for d in dims)  # torch's error, not a guess
                or len({d % x.dim() for d in dims}) != len(dims)
                or len(dims) == x.dim()):  # a whole-tensor reduction has no rows
            return NotImplemented
        return invariant_reduce(x, dims, keepdim, dtype, mean=mean, interpret=self.interpret)


def _active(kind: type) -> bool:
    """Whether a mode of ``kind`` is on already (the checks enter the mode around an engine's
    construction and again around its step: once is enough)."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    stack = (_get_current_dispatch_mode_stack() if issubclass(kind, TorchDispatchMode)
             else _get_current_function_mode_stack())
    return any(isinstance(mode, kind) for mode in stack)


@contextlib.contextmanager
def batch_invariant_ops(device: torch.device | str = "cpu") -> Iterator[None]:
    """The mode for a block of work on ``device``: on CPU the row-by-row ops on one thread, on
    CUDA the fixed-tile Triton kernels; restored after. Re-entered, it is a no-op."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"checks.batch_invariant: no batch-invariant mode on {kind}")
    mode = TritonBatchInvariantOps if kind == "cuda" else BatchInvariantOps
    if _active(mode):
        yield
        return
    if kind == "cuda":
        with TritonBatchInvariantOps("cuda"):
            yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with BatchInvariantOps():
            yield
    finally:
        torch.set_num_threads(threads)
