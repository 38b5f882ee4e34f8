"""The batch-invariant mode of the checks on CPU: every op computes a row with the same code and
the same shapes whatever batch the row sits in, so a replay batch's kept rows and the same rows
inside the full batch are equal bit for bit (issue 29; Thinking Machines' ``batch_invariant_ops``
and vLLM's ``VLLM_BATCH_INVARIANT`` are the prior art, for one batch size against another).

What makes a row's bits depend on its batch on this CPU, measured on ``sparse-tiny`` in fp32
(the bounded and halo E1 truth envelopes were 1.4e-6 to 2.4e-6 without this mode, 0 with it):

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
are invariant (checked in the tests). On CUDA the sources differ (cuBLAS split-K by row count,
the attention kernels' blocking), and this mode is refused there until fixed-tile kernels exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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
    """The ops above replaced while the mode is on (see the module docstring)."""

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


@contextlib.contextmanager
def batch_invariant_ops(device: torch.device | str = "cpu") -> Iterator[None]:
    """The mode for a block of work on ``device`` (CPU only), on one thread; restored after."""
    if torch.device(device).type != "cpu":
        raise ValueError("checks.batch_invariant: the batch-invariant mode runs on CPU only "
                         "(CUDA needs fixed-tile GEMM and attention kernels, not written yet)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with BatchInvariantOps():
            yield
    finally:
        torch.set_num_threads(threads)
