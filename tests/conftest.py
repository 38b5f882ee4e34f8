import pytest
import torch

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
