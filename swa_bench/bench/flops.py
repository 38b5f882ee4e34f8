"""FLOPs and peak memory of one call of a path.

FLOPs(full) / FLOPs(replay) is the ideal speedup that measured speedups are judged against; peak
memory is the extra memory a path needs above what was already allocated when it started.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``_grouped_mm(a [M, K], b [G, K, N], offs)``: every row of ``a`` meets one group's
    ``[K, N]``, so 2 M K N whatever the split (torch's counter has no formula for it)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


EXTRA_FLOP_FORMULAS = (
    {torch.ops.aten._grouped_mm: _grouped_mm_flops} if hasattr(torch.ops.aten, "_grouped_mm")
    else {}
)


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the ops ``fn`` dispatches (matmuls, attention, convolutions, grouped GEMMs), by
    torch's counter."""
    with FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        fn()
    return int(counter.get_total_flops())


def measure_peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above the level at entry."""
    device = torch.device(device)
    if device.type == "cuda":
        return _cuda_peak(fn, device)
    if device.type == "cpu":
        tracker = _LiveStorageTracker()
        try:
            with tracker:
                fn()
        finally:
            tracker.detach()
        return tracker.peak_bytes
    raise ValueError(f"peak memory supports cpu and cuda devices, got {device.type!r}")


def _cuda_peak(fn: Callable[[], object], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    at_entry = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - at_entry)


def _dense_tensors(tree: object) -> list[torch.Tensor]:
    """Strided tensors in ``tree`` (an op's args, kwargs or outputs: tuples, lists and dicts of
    tensors and scalars); sparse and other layouts have no single storage to key on. A walk of
    its own: pytree's flatten cost half of a CPU run's time, called twice on every op."""
    found: list[torch.Tensor] = []
    pending = [tree]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.layout == torch.strided:
                found.append(item)
        elif isinstance(item, (tuple, list)):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return found


class _LiveStorageTracker(TorchDispatchMode):
    """Bytes of storages created by ops inside the mode that are still alive, and their peak.

    A storage is keyed by its data pointer, so views and in-place results are counted once; an
    output that aliases one of the op's inputs is not new memory. A storage leaves the count when it
    is freed (``weakref.finalize`` on the untyped storage).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _dense_tensors((args, kwargs))}
        for t in _dense_tensors(out):
            if t.device.type == "cpu":
                self._track(t.untyped_storage(), inputs)
        return out

    def _track(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        if key == 0 or nbytes == 0 or key in inputs or key in self._live:
            return
        self._live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers[key] = weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live_bytes -= self._live.pop(key, 0)
        self._finalizers.pop(key, None)

    def detach(self) -> None:
        """Drop the finalizers of storages that outlive the measurement (the call's results)."""
        for finalizer in self._finalizers.values():
            finalizer.detach()
        self._finalizers.clear()
