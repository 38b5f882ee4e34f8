"""Capture sizes and padding a step to one (SPEC section 4)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default list: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return [s for s in sizes if s <= max_size]


def capture_sizes_problem(sizes: Sequence[int]) -> str | None:
    """The rule on a capture-size list (one definition: the scenario reports it against its
    field, the engine's config and the graph runner raise on it): non-empty, positive, strictly
    increasing, since ``padded_size`` bisects it."""
    if not sizes:
        return "must not be empty (null means vLLM's default sizes)"
    if any(s < 1 for s in sizes):
        return f"must be >= 1, got {list(sizes)}"
    if any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)):
        return f"must be strictly increasing, got {list(sizes)}"
    return None


def check_capture_sizes(sizes: Sequence[int]) -> None:
    if problem := capture_sizes_problem(sizes):
        raise ValueError(f"capture sizes {problem}")


def padded_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size holding ``num_tokens``; None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
