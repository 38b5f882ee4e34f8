"""A whole prompt as a scheduler runs it: its chunks, step after step, on caches carried from one
step to the next, then the first decode.

Step ``i`` prefills positions ``[i * chunk_size, min((i + 1) * chunk_size, length))`` of the
prompt (``RequestSpec(prompt_len=length, cached_len=i * chunk_size, chunk_size=chunk_size)``:
``prompt_len`` is the whole prompt, so policies that look at the prompt's end, final_window,
see it), batched with the decode rows beside it, each one token further per step. Nothing here
fills a cache but the decode rows' contexts (``fill_context``): every later state is what the
steps before left.

``chunk_request`` is that step's request, the one rule both users share: ``ChunkedPrompt`` (one
prompt beside decode rows, the checks and timing of ``workload.prompts``) and
``prefill_in_chunks`` (several prompts of one length side by side, chunk ``i`` of each in step
``i``: the task check's prompts, ``checks.tasks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swa_bench.engine.engine import Engine, StepOutput
from swa_bench.engine.step_inputs import StepInputs
from swa_bench.model.requests import RequestSpec


def num_chunks(length: int, chunk_size: int | None) -> int:
    """Steps that prefill a prompt of ``length`` tokens (``chunk_size`` None: one)."""
    return 1 if chunk_size is None else -(-length // chunk_size)


def chunk_request(length: int, chunk_size: int | None, i: int) -> RequestSpec:
    """Chunk ``i``'s request: positions ``[i * chunk_size, min((i + 1) * chunk_size, length))``
    after ``i * chunk_size`` cached ones. ``prompt_len`` is always the whole prompt (final_window
    keys its rows to the prompt's end). ``chunk_size`` None is the whole prompt in one cold step,
    the very request an unchunked prefill runs (``RequestSpec(length)``)."""
    if not 0 <= i < num_chunks(length, chunk_size):
        raise IndexError(f"chunk {i} of a prompt of {num_chunks(length, chunk_size)} chunks")
    if chunk_size is None:
        return RequestSpec(prompt_len=length)
    return RequestSpec(prompt_len=length, cached_len=i * chunk_size, chunk_size=chunk_size)


def prefill_in_chunks(engine: Engine, prompts: Sequence[Sequence[int]],
                      chunk_size: int | None,
                      cache_indices: Sequence[int] | None = None) -> StepOutput:
    """Prompts of one length, side by side (batch position ``j`` in cache slot
    ``cache_indices[j]``, default ``j``), prefilled as a scheduler does under chunked prefill:
    step ``i`` runs chunk ``i`` of every prompt on the caches the steps before left, nothing
    filled from elsewhere. Returns the last step's output: each prompt's last-token logits in
    batch order; the caches then hold the whole prompts, ready for decode rows after them
    (``step_inputs.decode_requests`` of ``RequestSpec(length)``). ``chunk_size`` None (or not
    below the length) is one cold step, bitwise what an unchunked prefill computes."""
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1:
        raise ValueError(f"prompts side by side share a length (a chunk index per step), got "
                         f"{sorted(lengths)}")
    (length,) = lengths
    out = None
    for i in range(num_chunks(length, chunk_size)):
        request = chunk_request(length, chunk_size, i)
        out = engine.step([request] * len(prompts),
                          [list(p[request.cached_len : request.seq_len]) for p in prompts],
                          cache_indices)
    return out


@dataclass(frozen=True)
class ChunkedPrompt:
    """One prompt (batch position 0) and the decode rows beside it (positions 1..n); ``sources``
    holds the tokens: the prompt's ``length`` tokens, and each decode row's context followed by
    one token per step (teacher-forced, so both paths feed the same rows)."""

    length: int
    chunk_size: int
    decode_context: int
    sources: StepInputs

    @classmethod
    def build(
        cls, length: int, chunk_size: int, *, vocab: int, seed: int, decodes_beside: int = 0,
        decode_context: int | None = None, cache_indices: Sequence[int] | None = None,
        held_out_text: bool = False,
    ) -> ChunkedPrompt:
        """Seeded tokens (``held_out_text``: held-out text, for trained weights), as a step's
        ``StepInputs`` would draw them."""
        if length < 1 or chunk_size < 1:
            raise ValueError(f"length and chunk_size must be >= 1, got {length}, {chunk_size}")
        context = length if decode_context is None else decode_context
        chunks = -(-length // chunk_size)
        specs = [RequestSpec(prompt_len=length)]
        specs += [RequestSpec(prompt_len=context + chunks + 1)] * decodes_beside
        sources = (StepInputs.held_out_text(specs, seed, cache_indices) if held_out_text
                   else StepInputs.seeded(specs, vocab, seed, cache_indices))
        return cls(length, chunk_size, context, sources)

    @property
    def decodes_beside(self) -> int:
        return len(self.sources.requests) - 1

    @property
    def tokens(self) -> tuple[int, ...]:
        """The prompt's tokens."""
        return self.sources.sequences[0]

    @property
    def num_chunks(self) -> int:
        return num_chunks(self.length, self.chunk_size)

    def step(self, i: int) -> StepInputs:
        """Chunk ``i``'s step: the chunk, then the decode rows at ``decode_context + i``."""
        chunk = chunk_request(self.length, self.chunk_size, i)
        decodes = [RequestSpec(prompt_len=self.decode_context + i, decode=True)]
        return StepInputs((chunk, *decodes * self.decodes_beside), self.sources.sequences,
                          self.sources.cache_indices)

    def steps(self) -> list[StepInputs]:
        return [self.step(i) for i in range(self.num_chunks)]

    def first_decode(self, token: int) -> StepInputs:
        """The step after the last chunk: the prompt's first decode row (``token``, sampled from
        the last chunk's logits) beside the decode rows one token further."""
        rows = (RequestSpec(prompt_len=self.length, decode=True),
                *[RequestSpec(prompt_len=self.decode_context + self.num_chunks, decode=True)]
                * self.decodes_beside)
        sequences = ((*self.tokens, token), *self.sources.sequences[1:])
        return StepInputs(rows, sequences, self.sources.cache_indices)

    def fill_context(self, engine: Engine) -> None:
        """The decode rows' contexts, as a reference prefill; the prompt starts from nothing."""
        self.step(0).fill_context(engine)
