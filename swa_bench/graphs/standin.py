"""A CPU stand-in for a CUDA graph segment: a tape of the ATen ops the segment ran.

Capture records every op with the very tensors it read and wrote; replay runs the ops again on
those tensors and copies results into the recorded outputs, so addresses stay fixed. Python does
not run at replay: shapes, branch decisions and Python scalars are frozen at capture, exactly as in
a CUDA graph, so code that reads mutable Python state inside a captured segment misbehaves on CPU
as it would on a GPU. Ops that need the host (``.item()``, data-dependent shapes) are refused at
capture, as stream capture refuses a synchronisation.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

HOST_SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}
UNINITIALISED_OPS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default}
# A collective's completion: it returns its input, yet replay must wait for the collective again.
WAIT_OPS = {torch.ops._c10d_functional.wait_tensor.default}


class CaptureError(RuntimeError):
    """A captured segment did something a CUDA graph cannot hold."""


def _aliases_inputs(outputs: tuple, args: tuple, kwargs: dict) -> bool:
    """Whether every output shares storage with an input: a view, nothing to redo at replay.

    Decided from the tensors, not the schema: ``to``, ``reshape`` and ``contiguous`` may alias or
    copy, and a copy must be redone.
    """
    storages = set()
    for a in [*args, *kwargs.values()]:
        for t in a if isinstance(a, (tuple, list)) else (a,):
            if isinstance(t, torch.Tensor):
                storages.add(t.untyped_storage().data_ptr())
    return all(
        isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in storages for o in outputs
    )


def _writes_inplace(func: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)


class _Op:
    __slots__ = ("func", "args", "kwargs", "outputs")

    def __init__(self, func, args, kwargs, outputs) -> None:
        self.func, self.args, self.kwargs, self.outputs = func, args, kwargs, outputs

    def replay(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.outputs is None:
            return
        results = result if isinstance(result, (tuple, list)) else (result,)
        for recorded, fresh in zip(self.outputs, results, strict=True):
            if recorded.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
                recorded.copy_(fresh)


class _TapeMode(TorchDispatchMode):
    def __init__(self, tape: list[_Op]) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC_OPS:
            raise CaptureError(f"{func} needs the host inside a captured segment")
        result = func(*args, **kwargs)
        if func in UNINITIALISED_OPS:
            return result
        if _writes_inplace(func) or func in WAIT_OPS:
            self.tape.append(_Op(func, args, kwargs, None))
            return result
        outputs = result if isinstance(result, (tuple, list)) else (result,)
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise CaptureError(f"{func} returns a host value inside a captured segment")
        if not _aliases_inputs(outputs, args, kwargs):
            self.tape.append(_Op(func, args, kwargs, tuple(outputs)))
        return result


class TapeSegment:
    """One recorded segment; ``begin``/``end`` bracket the code it records."""

    def __init__(self) -> None:
        self.tape: list[_Op] = []
        self._mode: _TapeMode | None = None

    def begin(self) -> None:
        self._mode = _TapeMode(self.tape)
        self._mode.__enter__()

    def end(self) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)

    def replay(self) -> None:
        for op in self.tape:
            op.replay()
