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


def replay_capture_sizes(
    window: int, *, max_capture_size: int, max_num_seqs: int, max_num_batched_tokens: int,
    sizes: Sequence[int] | None = None,
) -> list[int]:
    """The padded sizes replay batches are captured at (issue 34, after vLLM's
    ``DecoderReplayCudaGraphManager``): a replay batch keeps about W rows per request, so sizes
    step by W, and by 1/8 of the power-of-two interval ``[2^k, 2^(k+1))`` a size lies in once that
    is wider than W; up to ``min(max_capture_size, max_num_seqs * W)``, that bound itself the last
    size, so every batch up to it pads. ``sizes`` given: checked, not derived. A size above
    ``max_num_batched_tokens`` could never be filled by a step: a ValueError, as is a default
    bound above it."""
    if window < 1 or max_num_seqs < 1 or max_capture_size < 1:
        raise ValueError(
            f"replay capture sizes need window, max_num_seqs and max_capture_size >= 1, got "
            f"{window}, {max_num_seqs}, {max_capture_size}"
        )
    if sizes is None:
        bound = min(max_capture_size, max_num_seqs * window)
        sizes, size = [], window
        while size < bound:
            sizes.append(size)
            size += max(window, (1 << (size.bit_length() - 1)) // 8)
        sizes.append(bound)
    sizes = list(sizes)
    check_capture_sizes(sizes)
    if sizes[-1] > max_num_batched_tokens:
        raise ValueError(
            f"replay capture size {sizes[-1]} exceeds max_num_batched_tokens "
            f"{max_num_batched_tokens}: a step never holds that many rows"
        )
    return sizes
