"""Every module-level value a Triton kernel reads is a ``tl.constexpr``: compiled Triton refuses
any other global ("Cannot access global variable ... from within @jit'ed function") while the
interpreter, which the CPU tests run, reads it without complaint; a plain ``E4M3 = 0`` passed
every CPU test and failed each kernel's first launch on the H200."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest

import swa_bench.kernels as kernels_package

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

KERNEL_MODULES = [m.name for m in pkgutil.iter_modules(kernels_package.__path__)
                  if m.name.startswith("triton_")]


def test_there_are_kernel_modules_to_scan():
    assert {"triton_mqa", "triton_quant", "triton_rope"} <= set(KERNEL_MODULES)


@pytest.mark.parametrize("name", KERNEL_MODULES)
def test_jit_functions_read_only_constexpr_globals(name):
    module = importlib.import_module(f"swa_bench.kernels.{name}")
    # Under the interpreter (the CPU tests) ``triton.jit`` gives InterpretedFunction objects.
    kernel = triton.runtime.jit.KernelInterface
    offenders, scanned = [], 0
    for fn_name, obj in vars(module).items():
        fn = getattr(obj, "fn", None)
        if not isinstance(obj, kernel) or fn is None or fn.__module__ != module.__name__:
            continue  # not a kernel, or one imported from another module (scanned there)
        scanned += 1
        for global_name in fn.__code__.co_names:
            value = fn.__globals__.get(global_name)
            if value is None or isinstance(value, (types.ModuleType, kernel, tl.constexpr)):
                continue
            if not callable(value):
                offenders.append(f"{fn_name} reads {global_name} ({type(value).__name__})")
    assert scanned, f"no Triton function found in {name}"
    assert not offenders, offenders
