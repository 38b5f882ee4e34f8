"""What one request contributes to a step, in a serving engine's terms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    """One request's part of a step.

    A prefill step computes positions ``[cached_len, cached_len + query_len)`` of a prompt of
    ``prompt_len`` tokens; ``cached_len > 0`` is a prefix-cache hit or the chunks already run, and
    ``chunk_size`` caps this step's rows (chunked prefill). A decode row is one token at position
    ``prompt_len`` after ``prompt_len`` tokens of context.
    """

    prompt_len: int
    cached_len: int = 0
    chunk_size: int | None = None
    decode: bool = False
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")
        if self.cached_len < 0:
            raise ValueError(f"cached_len must be >= 0, got {self.cached_len}")
        if not self.decode and self.cached_len >= self.prompt_len:
            raise ValueError(
                f"cached_len ({self.cached_len}) must be below prompt_len ({self.prompt_len})"
            )
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def context_len(self) -> int:
        """Positions already in the caches before this step."""
        return self.prompt_len if self.decode else self.cached_len

    @property
    def query_len(self) -> int:
        """q: this request's rows in the step."""
        if self.decode:
            return 1
        remaining = self.prompt_len - self.cached_len
        return remaining if self.chunk_size is None else min(self.chunk_size, remaining)

    @property
    def seq_len(self) -> int:
        """The request's length after this step."""
        return self.context_len + self.query_len


def query_starts(requests: Sequence[RequestSpec]) -> list[int]:
    """Row offsets of each request in the packed batch, with the total last."""
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + r.query_len)
    return starts
