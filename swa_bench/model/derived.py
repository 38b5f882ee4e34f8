"""Tensors derived from weights alone (stacked projections, mixing matrices), kept on their
module and computed again only when a weight changes; never kept while a CUDA stream captures."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured: a cache filled now would hold a tensor
    of the graph's private pool, so derived tensors are then computed without being kept."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def derived_from_weights(owner: nn.Module, name: str, weights: Sequence[torch.Tensor],
                         compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``compute()``, a function of ``weights`` alone, kept on ``owner`` as ``name`` and computed
    again only when a weight changes (its storage or version counter). Not kept while a CUDA
    stream captures: the tensor would live in the graph's private pool."""
    key = tuple((w.data_ptr(), w._version) for w in weights)
    cached = getattr(owner, name, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute()
    if not capturing(weights[0].device):
        setattr(owner, name, (key, value))
    return value
