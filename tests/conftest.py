import importlib.util
import os

import pytest
import torch

# The Triton kernels' CPU tests run through Triton's interpreter, which must be on before anything
# imports triton (torch does, when swa_bench's custom ops register); the default backend on a CPU
# stays PyTorch whatever this says.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (`-n 2` in CI) each worker is one of the machine's cores: one intra-op
# thread each, or two workers' spin-waiting threads would fight over the two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

from swa_bench.engine.config import triton_interpreting
from swa_bench.model.args import PRESETS
from swa_bench.model.model import build_model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_args():
    return PRESETS["tiny"]


@pytest.fixture(scope="session")
def tiny_model(tiny_args):
    model, _ = build_model(tiny_args, seed=0)
    return model


@pytest.fixture
def interpreter():
    """The Triton kernels on CPU tensors through Triton's interpreter, switched on at the top of
    this file (skipped without triton, and where a GPU runs the compiled kernels instead). Under
    CI a missing triton fails: the ``[test]`` extra installs it on Linux x86_64."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail("triton is missing and CI is set: the Triton tests on CPU must run in CI")
        pytest.skip("triton is not installed")
    if torch.cuda.is_available() or not triton_interpreting():
        pytest.skip("the GPU runs the compiled kernels (tests marked cuda)")


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    the tiny model's GEMMs are too small to share, and two threads spin-waiting on a busy 2-core
    machine made the chunked-prompt tests 20x slower."""
    from swa_bench.bench.timing import num_threads

    with num_threads(1):
        yield
