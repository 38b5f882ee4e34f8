"""``launch``: a Triton kernel call whose host cost is the launch, not Triton's dispatch.

``kernel[grid](*args)`` binds the arguments, specialises each one, builds a cache key, packs
launch metadata for its hooks and looks the compiled kernel up on every call: about 18 us of
host time on the H200's host, more than a small step's kernels take on the GPU (a small eager
step launches about 150 Triton kernels). ``launch`` does that work once per specialisation: it
keys the compiled kernel by what Triton specialises on (each tensor's dtype and 16-byte
alignment, each integer's divisibility by 16 and width, the constexprs and launch options in
full: a finer key than Triton's, so a hit is always Triton's own choice), then calls the
compiled kernel's launcher directly, as Inductor's generated launchers do. The first call of
each key, a process with Triton launch hooks (a profiler's), and a call told not to launch
directly (``Kernels.direct_launch``: the interpreter, or the ``triton`` launch mode, an A/B
switch) take Triton's own path.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

_COMPILED: dict[tuple, tuple[object, tuple[str, ...]]] = {}
INT32 = 1 << 31


def specialization(kernel, args: Sequence[object]) -> tuple:
    """What the compiled kernel depends on in the positional ``args``: a constexpr's value, a
    tensor's dtype and 16-byte alignment, an integer's divisibility by 16, value 1 and width."""
    constexprs = kernel.constexprs
    key = []
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            key.append((arg.dtype, not arg.data_ptr() & 15))
        elif i in constexprs or isinstance(arg, (bool, str)) or arg is None:
            key.append(arg)
        elif isinstance(arg, int):
            key.append((not arg & 15, arg == 1, -INT32 <= arg < INT32))
        elif isinstance(arg, float):
            key.append(float)
        else:
            raise TypeError(f"launch: unexpected argument {type(arg).__name__} at {i}")
    return tuple(key)


def launch(kernel, grid: tuple[int, ...], *args, direct: bool, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, runtime arguments positional, constexprs and launch
    options by keyword; ``direct``: the caller's ``Kernels.direct_launch``."""
    if not direct:
        kernel[grid](*args, **kwargs)
        return
    driver = _driver()
    device = driver.get_current_device()
    key = (kernel, device, specialization(kernel, args), tuple(kwargs.items()))
    entry = _COMPILED.get(key)
    hooked = launch_hooks()
    if entry is None or hooked:
        compiled = kernel[grid](*args, **kwargs)
        rest = tuple(kernel.arg_names[len(args):])
        if not hooked and all(n in kwargs for n in rest) and not hasattr(compiled, "result"):
            _COMPILED[key] = (compiled, rest)
        return
    compiled, rest = entry
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 driver.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args,
                 *(kwargs[name] for name in rest))


@functools.cache
def _driver():
    from triton.runtime.driver import driver

    return driver.active


def launch_hooks() -> bool:
    """Whether any Triton launch hook is registered (a profiler's): then every call takes
    Triton's path, which calls them. (The hooks are ``HookChain`` objects, never None.)"""
    from triton import knobs

    return any(getattr(hook, "calls", hook is not None) for hook in
               (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
