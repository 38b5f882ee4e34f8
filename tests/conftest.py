import importlib.util
import os

import pytest
import torch

# The Triton kernels' CPU tests run through Triton's interpreter, which must be on before anything
# imports triton (torch does, when swa_bench's custom ops register); the default backend on a CPU
# stays PyTorch whatever this says.
if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
