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

    What a request asks of the engine (the replay gates, README "Engine gates"):

    * ``prompt_logprobs`` (vLLM) and ``context_logits`` (TensorRT-LLM): logits at every row of
      the step, so every row runs the decoder;
    * ``spec_decode_tokens`` (decode only): the decode row followed by that many speculative
      verify rows (positions ``prompt_len .. prompt_len + k``), each returning logits;
    * ``recomputed_rows`` (a prefix-cache hit served the vLLM way, ``prefix_hit_request``): the
      step's first rows recompute the window KV of a prefix hit ending at ``cached_len +
      recomputed_rows``. Window KV is not prefix-cached, so no window layer reads below
      ``cached_len`` (vLLM's ``replay_start``), and those rows write no global KV: the caches
      hold it from the hit.
    """

    prompt_len: int
    cached_len: int = 0
    chunk_size: int | None = None
    decode: bool = False
    prompt_logprobs: bool = False
    context_logits: bool = False
    spec_decode_tokens: int = 0
    recomputed_rows: int = 0

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
        if self.spec_decode_tokens < 0 or (self.spec_decode_tokens and not self.decode):
            raise ValueError("spec_decode_tokens: verify rows follow a decode row (>= 0, decode "
                             f"only), got {self.spec_decode_tokens}")
        if self.recomputed_rows < 0 or (self.recomputed_rows and (
                self.decode or self.recomputed_rows >= self.query_len)):
            raise ValueError(f"recomputed_rows ({self.recomputed_rows}) must be >= 0 and below "
                             "a prefill's rows in the step")

    @property
    def context_len(self) -> int:
        """Positions already in the caches before this step."""
        return self.prompt_len if self.decode else self.cached_len

    @property
    def query_len(self) -> int:
        """q: this request's rows in the step."""
        if self.decode:
            return 1 + self.spec_decode_tokens
        remaining = self.prompt_len - self.cached_len
        return remaining if self.chunk_size is None else min(self.chunk_size, remaining)

    @property
    def seq_len(self) -> int:
        """The request's length after this step."""
        return self.context_len + self.query_len

    @property
    def filled_len(self) -> int:
        """Positions the caches hold global KV for before this step: the context, and under
        ``recomputed_rows`` the prefix hit those rows recompute window KV for."""
        return self.context_len + self.recomputed_rows

    @property
    def every_row_logits(self) -> bool:
        """Whether the step returns logits at each of the request's rows (prompt logprobs,
        context logits, speculative verify rows), not only at its last."""
        return self.prompt_logprobs or self.context_logits or self.spec_decode_tokens > 0


def prefix_hit_request(
    prompt_len: int, hit: int, window: int, *, chunk_size: int | None = None,
    prompt_logprobs: bool = False, context_logits: bool = False,
) -> RequestSpec:
    """The step vLLM runs for a prompt with a prefix-cache hit of ``hit`` tokens, decided here
    once, before the step is planned (it changes the step's rows).

    vLLM keeps window KV out of prefix caching and rebuilds it after a hit by recomputing the
    hit's last window (``vllm/models/deepseek_v41/nvidia/model_state.py``,
    ``DeepseekV41ModelState``: "rebuilds it after a prefix hit by recomputing the hit's last
    window", its replay start handed to every sliding-window builder, the replayed rows' slots in
    the prefix-cacheable groups padded "so the cached KV stays as is"): the step computes
    ``[hit - W, prompt_len)`` with no window read below ``hit - W``. A hit of W tokens or fewer
    leaves nothing to reuse and is not adopted: the prompt runs from 0 (this rule is the issue's
    text, issue 30; vLLM's scheduler side was not found in the public code). Under
    ``chunk_size`` the first chunk must hold the recomputed rows and more (the scenario checks).
    """
    if hit <= window:
        return RequestSpec(prompt_len, chunk_size=chunk_size, prompt_logprobs=prompt_logprobs,
                           context_logits=context_logits)
    return RequestSpec(prompt_len, cached_len=hit - window, chunk_size=chunk_size,
                       prompt_logprobs=prompt_logprobs, context_logits=context_logits,
                       recomputed_rows=window)


def query_starts(requests: Sequence[RequestSpec]) -> list[int]:
    """Row offsets of each request in the packed batch, with the total last."""
    starts = [0]
    for r in requests:
        starts.append(starts[-1] + r.query_len)
    return starts
